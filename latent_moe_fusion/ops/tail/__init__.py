"""lmf::latent_tail: the latent up-projection plus the shared fragments (tail_op.py), its checks and reference, and
its backends: Triton (triton/, on the kernels in common/tail_gemm) and CuTe DSL (cute/, optional). Importing this
package defines the op and registers its backends."""

from . import tail_reference  # noqa: F401  (registers the backend)
from .tail_op import latent_tail
from .triton import triton_tail_backend  # noqa: F401  (registers the backend)

try:  # CuTe DSL backends: registering them imports no cutlass, and must never break importing the package
    from . import cute as _cute  # noqa: F401
except Exception as _exc:  # pragma: no cover - a broken optional install
    import warnings

    warnings.warn(f"latent_moe_fusion: CuTe DSL backends not registered ({_exc})", stacklevel=1)

__all__ = ["latent_tail"]
