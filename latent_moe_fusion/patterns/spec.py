"""One registered pattern: a form (how the shared output is reduced) times a variant of the block.

A `PatternSpec` builds the search function (the unfused block from `lmf::routed_experts` to the
final add), the replacement (`lmf::moe_shared_producer` then `lmf::latent_tail`) and meta-device
example inputs. Patterns are per dtype and weight format (both are literal in the traced graph) and,
for the collective forms, per process group (its name and size are literal arguments of the
collectives).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops  # noqa: F401  (registers torch.ops.lmf.*)
from .pieces import RMS_NORMS, gate_up_merged, gate_up_split, linear, merged_row_blocks, situ

GATE_UP_FORMS = ("merged", "split")
NORM_FORMS = tuple(RMS_NORMS)
WEIGHT_FORMATS = ("bf16", "mxfp4")

# Example values of the scalar pattern arguments: the pattern matcher turns every constant equal to
# one of them into a keyword argument, so they must differ from every other constant in the pattern.
SCALAR_EXAMPLES = {"eps": 1.2345e-5, "beta": 3.217, "lin_beta": 23.71}


@dataclass(frozen=True)
class Form:
    """How this rank's partial shared-expert output reaches the final add."""

    name: str  # "local" | "all_reduce" | "sequence_parallel"
    mode: str  # the layout the fused ops use for it
    description: str
    reduce_shared: Callable[[torch.Tensor, str | None, int], torch.Tensor]  # (s_partial, group, R) -> s
    shared_rows: Callable[[int, int], int]  # (tokens M of this rank, R) -> rows of x_s


@dataclass(frozen=True)
class PatternSpec:
    form: Form
    gate_up: str  # "merged" | "split"
    norm: str  # "functional" | "manual"
    dtype: torch.dtype
    weight_format: str  # "bf16" | "mxfp4"
    group_name: str | None = None
    world: int = 1

    @property
    def variant(self) -> str:
        return f"gate_up={self.gate_up}, rms_norm={self.norm}, {str(self.dtype).replace('torch.', '')}, weights={self.weight_format}"

    @property
    def name(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        group = "" if self.group_name is None else f"_g{self.group_name}_r{self.world}"
        return f"lmf_{self.form.name}_{self.gate_up}_{self.norm}_{dtype}_{self.weight_format}{group}"

    # -- argument lists ----------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        names = ["z", "topk_ids", "topk_weights", "w13", "w2"]
        if self.weight_format == "mxfp4":
            names += ["w13_scale", "w2_scale"]
        names += ["norm_weight", "w_up", "x_s"]
        names += ["shared_w13"] if self.gate_up == "merged" else ["shared_w1", "shared_w3"]
        return names + ["shared_w2"]

    def arg_names(self) -> list[str]:
        return self.tensor_names() + list(SCALAR_EXAMPLES)

    # -- search and replacement ----------------------------------------------------------------
    def _routed(self, a: dict[str, Any]) -> torch.Tensor:
        return torch.ops.lmf.routed_experts(
            a["z"], a["topk_ids"], a["topk_weights"], a["w13"], a["w2"],
            a.get("w13_scale"), a.get("w2_scale"), self.weight_format, a["beta"], a["lin_beta"],
        )

    def _gate_up(self, a: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gate_up == "merged":
            return gate_up_merged(a["x_s"], a["shared_w13"])
        return gate_up_split(a["x_s"], a["shared_w1"], a["shared_w3"])

    def search(self, a: dict[str, Any]) -> torch.Tensor:
        y = self._routed(a)
        y_n = RMS_NORMS[self.norm](y, a["norm_weight"], a["eps"])
        u = linear(y_n, a["w_up"])
        gate, up = self._gate_up(a)
        s_partial = linear(situ(gate, up, a["beta"], a["lin_beta"]), a["shared_w2"])
        return u + self.form.reduce_shared(s_partial, self.group_name, self.world)

    def replace(self, a: dict[str, Any]) -> torch.Tensor:
        if self.gate_up == "merged":
            w1_s, w3_s = merged_row_blocks(a["shared_w13"])
        else:
            w1_s, w3_s = a["shared_w1"], a["shared_w3"]
        y_n, ws = torch.ops.lmf.moe_shared_producer(
            a["z"], a["topk_ids"], a["topk_weights"], a["w13"], a["w2"],
            a.get("w13_scale"), a.get("w2_scale"), self.weight_format, a["beta"], a["lin_beta"],
            a["norm_weight"], a["eps"], a["x_s"], w1_s, w3_s, a["shared_w2"], self.form.mode, self.group_name,
        )
        return torch.ops.lmf.latent_tail(y_n, a["w_up"], ws, self.form.mode, self.group_name)

    def search_fn(self) -> Callable[..., torch.Tensor]:
        return _with_signature(self.arg_names(), self.search)

    def replace_fn(self) -> Callable[..., torch.Tensor]:
        return _with_signature(self.arg_names(), self.replace)

    # -- example inputs (meta device: no data, no process group needed) ------------------------
    def example_inputs(self) -> list[torch.Tensor]:
        """Small, mutually distinct sizes; the matcher ignores sizes and re-checks real ones."""
        m, hidden, latent, experts, top_k, inter, inter_s = 4, 64, 32, 4, 2, 32, 16
        dt, meta = self.dtype, "meta"

        def t(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=meta)

        x = {
            "z": t(m, latent),
            "topk_ids": t(m, top_k, dtype=torch.int32),
            "topk_weights": t(m, top_k, dtype=torch.float32),
            "norm_weight": t(latent),
            "w_up": t(hidden, latent),
            "x_s": t(self.form.shared_rows(m, self.world), hidden),
            "shared_w13": t(2 * inter_s, hidden),
            "shared_w1": t(inter_s, hidden),
            "shared_w3": t(inter_s, hidden),
            "shared_w2": t(hidden, inter_s),
        }
        if self.weight_format == "mxfp4":
            u8 = torch.uint8
            x |= {
                "w13": t(experts, 2 * inter, latent // 2, dtype=u8),
                "w2": t(experts, latent, inter // 2, dtype=u8),
                "w13_scale": t(experts, 2 * inter, latent // 32, dtype=u8),
                "w2_scale": t(experts, latent, inter // 32, dtype=u8),
            }
        else:
            x |= {"w13": t(experts, 2 * inter, latent), "w2": t(experts, latent, inter)}
        return [x[name] for name in self.tensor_names()]


def _with_signature(names: list[str], body: Callable[[dict[str, Any]], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A positional function with named parameters: the pattern matcher names its inputs after them."""

    def fn(*args: Any) -> torch.Tensor:
        return body(dict(zip(names, args, strict=True)))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    fn.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in names])
    return fn
