"""The unfused Kimi K3 latent-MoE block on one tensor-parallel rank (docs/design.md, section 1)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .. import ops  # noqa: F401  (registers torch.ops.lmf.*)
from ..kimi_k3_config import KimiK3MoEConfig
from .layers import RMS_NORMS, situ_activation
from .router import ROUTER_GEMMS, localize_ids, route
from .weights import expert_weights, normal

SHARED_GATE_UP_FORMS = ("merged", "split")


def _check_same_expert_share(tp_group: dist.ProcessGroup, ep_rank: int) -> None:
    """A TP block (not SP) with an EP share: every rank must hold the same share. The TP form replicates the routed
    branch (same tokens, same experts on every rank) and all-reduces only the shared expert; with different shares
    each rank's routed output differs, the block's output would differ across ranks, and the fused tail
    (`hidden_scatter`: each rank computes its columns of the up-projection from its own routed output, then the
    columns are all-gathered) could not reproduce it. SP blocks route their own tokens and may hold any share."""
    shares: list[int | None] = [None] * dist.get_world_size(tp_group)
    dist.all_gather_object(shares, ep_rank, group=tp_group)
    if len(set(shares)) > 1:
        raise ValueError(f"tensor-parallel block with expert-parallel shares {shares} (ep_rank per TP rank): the TP form "
                         "replicates the routed branch, so every TP rank needs the same ep_rank (or ep_size=1); an "
                         "expert-parallel layout needs its own combine of the routed outputs before the up-projection")


class KimiK3MoEBlock(nn.Module):
    """x [M, H] -> u + s, the reference the fusion pass rewrites.

    tp_group: the TP process group (None: R = 1). sequence_parallel: x holds this rank's tokens;
    the shared expert all-gathers x and reduce-scatters its output. Beyond docs/design.md's API:
    shared_gate_up ('merged' one [2 I_s/R, H] matmul, or 'split' two), rms_norm ('functional'
    F.rms_norm or 'manual' float32 form), router_gemm ('fp32' the HF reference, or 'bf16' a BF16
    tensor-core GEMM with FP32 logits on CUDA, as serving engines run it: see router.router_logits),
    and ep_size/ep_rank (this rank keeps experts ep_rank*E/ep_size.. and skips the rest: for
    single-GPU benchmarks of one EP share).
    """

    def __init__(
        self,
        cfg: KimiK3MoEConfig,
        tp_group: dist.ProcessGroup | None = None,
        sequence_parallel: bool = False,
        weight_format: str = "bf16",
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        seed: int = 0,
        *,
        shared_gate_up: str = "merged",
        rms_norm: str = "functional",
        router_gemm: str = "fp32",
        ep_size: int = 1,
        ep_rank: int = 0,
    ) -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
        if shared_gate_up not in SHARED_GATE_UP_FORMS:
            raise ValueError(f"shared_gate_up must be one of {SHARED_GATE_UP_FORMS}, got {shared_gate_up!r}")
        if rms_norm not in RMS_NORMS:
            raise ValueError(f"rms_norm must be one of {tuple(RMS_NORMS)}, got {rms_norm!r}")
        if router_gemm not in ROUTER_GEMMS:
            raise ValueError(f"router_gemm must be one of {ROUTER_GEMMS}, got {router_gemm!r}")
        self.tp_world = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        if sequence_parallel and tp_group is None:
            raise ValueError("sequence_parallel=True needs a tp_group")
        cfg.validate_for(self.tp_world, weight_format, ep_size)
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank must be in [0, {ep_size}), got {ep_rank}")
        if tp_group is not None and self.tp_world > 1 and not sequence_parallel and ep_size > 1:
            _check_same_expert_share(tp_group, ep_rank)
        self.cfg = cfg
        self.group_name = None if tp_group is None else tp_group.group_name
        self.sequence_parallel = sequence_parallel
        self.weight_format = weight_format
        self.shared_gate_up = shared_gate_up
        self.rms_norm_form = rms_norm
        self.router_gemm = router_gemm
        self.num_local_experts = cfg.num_experts // ep_size
        self.first_expert = ep_rank * self.num_local_experts
        self.ep_size = ep_size
        device = torch.device(device)
        h, lat, e, i = cfg.hidden_size, cfg.latent_size, cfg.num_experts, cfg.moe_intermediate_size

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.gate_weight = param(normal((e, h), h**-0.5, seed, "gate", device, dtype))
        self.correction_bias = param(normal((e,), 0.1, seed, "gate.bias", device))
        self.w_down = param(normal((lat, h), h**-0.5, seed, "down", device, dtype))
        self.w_up = param(normal((h, lat), lat**-0.5, seed, "up", device, dtype))
        # 1 + noise in fp32, rounded once: the bf16 block's weights are the fp32 block's, rounded.
        self.norm_weight = param((1.0 + normal((lat,), 0.1, seed, "norm", device)).to(dtype))
        w13, s13 = expert_weights(self.num_local_experts, self.first_expert, 2 * i, lat, seed, "w13", weight_format, dtype, device)
        w2, s2 = expert_weights(self.num_local_experts, self.first_expert, lat, i, seed, "w2", weight_format, dtype, device)
        self.w13 = param(w13)
        self.w2 = param(w2)
        self.w13_scale = None if s13 is None else param(s13)
        self.w2_scale = None if s2 is None else param(s2)
        # Shared expert: full weights from the seed, this rank keeps its slice of I_s.
        i_s = cfg.shared_intermediate_size
        shard = slice(self.tp_rank * i_s // self.tp_world, (self.tp_rank + 1) * i_s // self.tp_world)
        w1_s = normal((i_s, h), h**-0.5, seed, "shared.w1", device, dtype)[shard]
        w3_s = normal((i_s, h), h**-0.5, seed, "shared.w3", device, dtype)[shard]
        w2_s = normal((h, i_s), i_s**-0.5, seed, "shared.w2", device, dtype)[:, shard]
        if shared_gate_up == "merged":
            self.shared_w13 = param(torch.cat([w1_s, w3_s], dim=0).contiguous())
        else:
            self.shared_w1 = param(w1_s.contiguous())
            self.shared_w3 = param(w3_s.contiguous())
        self.shared_w2 = param(w2_s.contiguous())

    # -- pieces -------------------------------------------------------------------------------
    def routed(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        ids, weights = route(x, self.gate_weight, self.correction_bias, cfg.top_k, cfg.routed_scaling_factor,
                             self.router_gemm)
        if self.ep_size > 1:
            ids = localize_ids(ids, self.first_expert, self.num_local_experts)
        z = F.linear(x, self.w_down)
        return torch.ops.lmf.routed_experts(
            z, ids, weights, self.w13, self.w2, self.w13_scale, self.w2_scale,
            self.weight_format, cfg.situ_beta, cfg.situ_linear_beta,
        )

    def shared(self, x_s: torch.Tensor) -> torch.Tensor:
        if self.shared_gate_up == "merged":
            g, u = F.linear(x_s, self.shared_w13).chunk(2, dim=-1)
        else:
            g, u = F.linear(x_s, self.shared_w1), F.linear(x_s, self.shared_w3)
        act = situ_activation(g, u, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return F.linear(act, self.shared_w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.routed(x)
        y_n = RMS_NORMS[self.rms_norm_form](y, self.norm_weight, self.cfg.rms_norm_eps)
        u = F.linear(y_n, self.w_up)
        c10d = torch.ops._c10d_functional
        if self.tp_world == 1:
            s = self.shared(x)
        elif self.sequence_parallel:
            x_s = c10d.wait_tensor(c10d.all_gather_into_tensor(x, self.tp_world, self.group_name))
            s_partial = self.shared(x_s)
            s = c10d.wait_tensor(c10d.reduce_scatter_tensor(s_partial, "sum", self.tp_world, self.group_name))
        else:
            s = c10d.wait_tensor(c10d.all_reduce(self.shared(x), "sum", self.group_name))
        return u + s
