"""What the fusion pass is allowed to rewrite. Every field is the same on every rank by construction
(it is code, not state), so decisions taken from it are rank-consistent."""

from __future__ import annotations

from dataclasses import dataclass

from ..patterns import FORMS, GATE_UP_FORMS, NORM_FORMS, WEIGHT_FORMATS

DTYPE_NAMES = ("bfloat16", "float32")


@dataclass(frozen=True)
class FusionConfig:
    forms: tuple[str, ...] = tuple(FORMS)  # "local", "all_reduce", "sequence_parallel"
    gate_up_forms: tuple[str, ...] = GATE_UP_FORMS  # "merged", "split"
    norm_forms: tuple[str, ...] = NORM_FORMS  # "functional", "manual"
    dtypes: tuple[str, ...] = DTYPE_NAMES
    weight_formats: tuple[str, ...] = WEIGHT_FORMATS
    # Device types on which the pure-PyTorch reference backend counts as serving the fused ops. On a
    # GPU the reference producer loops over experts with host syncs: fusing onto it would be slower
    # than the unfused block, so there a faster backend must serve the candidate or it stays unfused.
    reference_backend_devices: tuple[str, ...] = ("cpu",)
    # Rewrite the router's sigmoid / top-k / renormalisation chain into lmf::noaux_tc_route (routing.py).
    fuse_routing: bool = True
    # Put a fused router's gate GEMM and route beside the latent down-projection of the same tokens, in one
    # lmf::route_and_project (router_overlap.py): on CUDA the two run side by side instead of in a row.
    overlap_router: bool = True
    # With overlap_router: where the route and the down-projection feed the fused block's producer directly,
    # take the producer into the op too (lmf::route_and_produce): on CUDA its shared expert then starts first,
    # beside the router and the down-projection, instead of beside the routed kernels.
    shared_first: bool = True
    # With shared_first: where the producer is an SP block's whose x_s is the all-gather of the router's tokens, used
    # by nothing else, take the gather into the op too (lmf::route_gather_and_produce): it runs on the shared
    # expert's stream, so the router and the down-projection no longer wait for every rank's tokens.
    gather_tokens: bool = True
    # A walk from routed_experts that needs more nodes than this is not a block of this shape.
    max_walk_nodes: int = 64

    def __post_init__(self) -> None:
        for field, allowed in (
            ("forms", tuple(FORMS)),
            ("gate_up_forms", GATE_UP_FORMS),
            ("norm_forms", NORM_FORMS),
            ("dtypes", DTYPE_NAMES),
            ("weight_formats", WEIGHT_FORMATS),
        ):
            value = getattr(self, field)
            if not isinstance(value, tuple) or not set(value) <= set(allowed):
                raise ValueError(f"FusionConfig.{field} must be a tuple drawn from {allowed}, got {value!r}")
        if self.max_walk_nodes < 8:
            raise ValueError(f"FusionConfig.max_walk_nodes must be >= 8, got {self.max_walk_nodes}")

    def pattern_set(self) -> list[str]:
        """Names of the pattern families this configuration registers (groups are added per graph)."""
        routing = ["router/noaux_tc"] if self.fuse_routing else []
        routing += ["router/beside_down_projection"] if self.fuse_routing and self.overlap_router else []
        with_producer = self.fuse_routing and self.overlap_router and self.shared_first
        routing += ["router/with_producer"] if with_producer else []
        routing += ["router/with_token_gather"] if with_producer and self.gather_tokens else []
        return routing + [
            f"{form}/{gate_up}/{norm}/{dtype}/{fmt}"
            for form in self.forms
            for gate_up in self.gate_up_forms
            for norm in self.norm_forms
            for dtype in self.dtypes
            for fmt in self.weight_formats
        ]
