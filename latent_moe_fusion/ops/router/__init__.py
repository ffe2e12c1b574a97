"""lmf::noaux_tc_route: Kimi K3's router after the gate GEMM (noaux_tc_route.py), its Triton backend (triton/).
Importing this package defines the op and registers its backends."""

from .noaux_tc_route import noaux_tc_route
from .triton import route_topk  # noqa: F401  (registers the backend)

__all__ = ["noaux_tc_route"]
