"""Custom ops (namespace `lmf`) and their backends."""

from .backends import Backend, register_backend, select_backend
from .library import latent_tail, moe_shared_producer, routed_experts
from .mxfp4 import dequantize_mxfp4, quantize_mxfp4
from .route_and_produce import route_and_produce
from .route_and_project import route_and_project
from .routing import noaux_tc_route
from .validation import LmfInputError

__all__ = [
    "Backend",
    "LmfInputError",
    "dequantize_mxfp4",
    "latent_tail",
    "moe_shared_producer",
    "noaux_tc_route",
    "quantize_mxfp4",
    "register_backend",
    "route_and_produce",
    "route_and_project",
    "routed_experts",
    "select_backend",
]
