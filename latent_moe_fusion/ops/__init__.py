"""Custom ops (namespace `lmf`) and their backends, one folder per op family:

    routed/  lmf::routed_experts, lmf::moe_shared_producer, and the ops that put the router in front of them:
             lmf::route_and_project, lmf::route_and_produce, lmf::route_gather_and_produce (Triton, Gluon and DeepGEMM
             backends)
    router/  lmf::noaux_tc_route
    tail/    lmf::latent_tail (Triton and CuTe DSL backends)
    common/  what several families use: backend registry, op definition, argument checks, reference math, MXFP4,
             fragment layouts and their cross-rank movement, PDL, streams, the tail kernel the down-projection reuses

No family imports another (tests/test_package_layout.py); importing this package defines every op and registers
every backend.
"""

from .common.backends import Backend, register_backend, select_backend
from .common.input_checks import LmfInputError
from .common.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from .routed import moe_shared_producer, route_and_produce, route_and_project, route_gather_and_produce, routed_experts
from .router import noaux_tc_route
from .tail import latent_tail

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
    "route_gather_and_produce",
    "routed_experts",
    "select_backend",
]
