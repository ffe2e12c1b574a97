"""The compile harnesses' one way to build a Triton / Gluon source for an offline sm_90 compile.

A launch fills every parameter the caller leaves out with its default; an offline compile does not, on every Triton:
3.6 filled them in, 3.7 and later leave them None (a constexpr such as STAGES or SIGNAL then compiles to the wrong
kernel, or fails). So the harnesses fill the defaults themselves, here.
"""

from __future__ import annotations

from typing import Any


def with_defaults(fn: Any, signature: dict[str, Any], constexprs: dict[str, Any] | None) -> tuple[dict, dict]:
    """(signature, constexprs) with every constexpr parameter of `fn` that has a default and is not given added."""
    signature, constexprs = dict(signature), dict(constexprs or {})
    for param in fn.params:
        if param.is_constexpr and param.has_default and param.name not in constexprs:
            constexprs[param.name] = param.default
            signature.setdefault(param.name, "constexpr")
    return signature, constexprs


def ast_source(fn: Any, signature: dict[str, Any], constexprs: dict[str, Any] | None = None,
               attrs: dict | None = None, gluon: bool = False) -> Any:
    """ASTSource (or GluonASTSource with gluon=True) with the defaults filled in (module docstring)."""
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Source
    else:
        from triton.compiler import ASTSource as Source
    signature, constexprs = with_defaults(fn, signature, constexprs)
    return Source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
