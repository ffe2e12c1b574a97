"""The routed experts and the ops built on them:

    lmf::routed_experts       the routed experts in the latent space (routed_experts_op.py)
    lmf::moe_shared_producer  routed experts + RMSNorm + the shared expert in the same launches (producer_op.py)
    lmf::route_and_project    the router and the latent down-projection side by side (router_fused/)
    lmf::route_and_produce    route_and_project and the producer as one op, the shared expert first (router_fused/)
    lmf::route_gather_and_produce
                              route_and_produce for SP, gathering the tokens itself beside the router (router_fused/)

Backends: reference (expert_reference.py), Triton (expert_triton_backend.py, producer_triton_backend.py: the
plan of routed_plan.py picks the kernels of triton/ and gluon/, expert_schedule.py launches them), DeepGEMM (deepgemm/, optional: importing
it never imports deep_gemm). Importing this package defines the ops and registers their backends.
"""

from . import deepgemm, expert_reference, expert_triton_backend, producer_triton_backend  # noqa: F401  (registers the backends)
from .producer_op import moe_shared_producer
from .routed_experts_op import routed_experts
from .router_fused.route_and_produce import route_and_produce
from .router_fused.route_and_project import route_and_project
from .router_fused.route_gather_and_produce import route_gather_and_produce

__all__ = ["moe_shared_producer", "route_and_produce", "route_and_project", "route_gather_and_produce", "routed_experts"]
