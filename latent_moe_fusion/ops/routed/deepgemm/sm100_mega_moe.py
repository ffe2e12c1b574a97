"""lmf::moe_shared_producer on DeepGEMM's SM100 MegaMoE with a BF16 shared expert (NOT RUN ON HARDWARE HERE).

API mapped (read from gcanlin/DeepGEMM, the fork behind deepseek-ai/DeepGEMM PR #416
"[SM100][MegaMoE] Fuse and publish Kimi K3's BF16 shared expert"; files deep_gemm/mega/__init__.py,
csrc/apis/mega.hpp, tests/test_mega_moe_situ.py at commit f6e92ef2):

  fp8_fp4_mega_moe_bf16_shared(y, shared_y, l1_weights, l2_weights, shared_x, shared_l1_weights,
      shared_l2_weights, rms_weight, rms_epsilon, sym_buffer, cumulative_local_expert_recv_stats=None,
      recipe=(1, 1, 32), activation='situ', fast_math=True, situ_beta=None, situ_linear_beta=None)
  fp8_fp4_mega_moe_bf16_shared_rs(y, l1_weights, ..., rms_epsilon, shared_rs_workspace,
      shared_rs_flags, shared_rs_peer_ptrs, sym_buffer, ...)        # same tail as above
  fp8_fp4_mega_moe_bf16_shared_sp_rs(...)                            # same parameters as _rs

Our contract -> their arguments:
  y            [M, L] bf16 out: RMSNorm(routed) with rms_weight [L] bf16 and rms_epsilon = our y_n
  routed input z -> FP8 e4m3 + packed UE8M0 per 32 copied into sym_buffer.x / x_sf (formats.py);
               ids -> sym_buffer.topk_idx int64, offset by rank * E (sm100_state.py explains why);
               weights -> sym_buffer.topk_weights fp32
  l1_weights   (int8 packed FP4 [E, 2I, L/2], int32 packed UE8M0 sf), from our w13/w13_scale through
               transform_sf_into_required_layout(sf, mn=2I, k=L, recipe=(1, 32), num_groups=E) and
               transform_weights_for_mega_moe(..., activation='situ') (gate/up interleave, UTCCP sf)
  l2_weights   likewise from w2 [E, L, I/2]
  shared_x     x_s [M_s, H] bf16; shared_l1_weights = transform of cat([w1_s, w3_s]) [2 I_s, H];
               shared_l2_weights = w2_s [H, I_s]
  mode local          -> _bf16_shared with shared_y = ws[0]                      ws [1, M, H]
  mode hidden_scatter -> _rs: workspace [G, M, R, H/R], written by every rank into the owner of
                         each column slice; ours is rank-major [R, M, H/R], so one transposing copy
  mode token_publish  -> _sp_rs: workspace [G, M, R, H] = our [M, R, H] layout, no transpose

Numerics differ from the contract in one place, which is why this backend is opt-in
(LMF_DEEPGEMM_FP8_ACTIVATIONS=1): MegaMoE quantizes the routed activations (z and the SiTU
output) to FP8 e4m3 with per-32 UE8M0 scales, where the contract keeps them in BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latent_moe_fusion import envs

from .agree import agreed_for, current_answer
from .formats import e8m0_as_float, mxfp4_weight_as_deepgemm, quantize_fp8_ue8m0
from .probe import SM100_MEGA, deep_gemm_module
from .sm100_state import ProducerState, state_for
from .weight_cache import WeightCache

FP8_OPT_IN = "LMF_DEEPGEMM_FP8_ACTIVATIONS"
_ROUTED = WeightCache("DeepGEMM MegaMoE routed weights")
_SHARED = WeightCache("DeepGEMM MegaMoE shared-expert weights")


@dataclass
class RoutedWeights:
    l1: tuple[torch.Tensor, torch.Tensor]
    l2: tuple[torch.Tensor, torch.Tensor]


@dataclass
class SharedWeights:
    l1: torch.Tensor
    l2: torch.Tensor


def routed_weights(w13, w2, w13_scale, w2_scale) -> RoutedWeights:
    def convert() -> RoutedWeights:
        dg = deep_gemm_module()
        num_experts, two_inter, half_latent = w13.shape
        latent, inter = 2 * half_latent, two_inter // 2
        sf13 = dg.transform_sf_into_required_layout(
            sf=e8m0_as_float(w13_scale), mn=two_inter, k=latent, recipe=(1, 32), num_groups=num_experts
        )
        sf2 = dg.transform_sf_into_required_layout(
            sf=e8m0_as_float(w2_scale), mn=latent, k=inter, recipe=(1, 32), num_groups=num_experts
        )
        l1, l2 = dg.transform_weights_for_mega_moe(
            l1_weights=(mxfp4_weight_as_deepgemm(w13), sf13),
            l2_weights=(mxfp4_weight_as_deepgemm(w2), sf2),
            activation="situ",
        )
        return RoutedWeights(tuple(l1), tuple(l2))

    return _ROUTED.get((w13, w2, w13_scale, w2_scale), convert)


def shared_weights(w1_s, w3_s, w2_s) -> SharedWeights:
    def convert() -> SharedWeights:
        dg = deep_gemm_module()
        # MegaMoE's shared L1 is one [gate rows | up rows] matrix (it interleaves them itself).
        l1, l2 = dg.transform_weights_for_mega_moe(
            l1_weights=torch.cat([w1_s, w3_s], dim=0), l2_weights=w2_s.contiguous(), activation="situ"
        )
        return SharedWeights(l1, l2)

    return _SHARED.get((w1_s, w3_s, w2_s), convert)


def convert_weights(w13, w2, w13_scale, w2_scale, w1_s, w3_s, w2_s) -> None:
    """Convert (and cache) every weight MegaMoE reads; run at load, outside capture."""
    routed_weights(w13, w2, w13_scale, w2_scale)
    shared_weights(w1_s, w3_s, w2_s)


def clear_weight_caches() -> None:
    _ROUTED.clear()
    _SHARED.clear()


def available() -> str | None:
    return current_answer().why_not(SM100_MEGA)


def supports(
    z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta, lin_beta,
    rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name=None,
) -> str | None:
    """Why the MegaMoE mapping cannot serve these arguments (None: it can). Same answer on every rank."""
    agreed = agreed_for(group_name)
    if agreed is None or not agreed.has(SM100_MEGA):
        return (f"DeepGEMM MegaMoE not agreed for group {group_name!r}: call "
                "latent_moe_fusion.ops.routed.deepgemm.prepare_deepgemm_producer on every rank first")
    if not envs.read(FP8_OPT_IN):
        return (f"MegaMoE quantizes routed activations to FP8 e4m3 (the contract keeps BF16); set {FP8_OPT_IN}=1 "
                "to accept that")
    state = state_for(group_name, mode)
    if state is None:
        return (f"no MegaMoE workspace for mode={mode!r}, group={group_name!r}: call "
                "prepare_deepgemm_producer before forward (outside CUDA-graph capture)")
    if weight_format != "mxfp4":
        return f"MegaMoE FP8xFP4 needs mxfp4 routed weights, got weight_format={weight_format!r}"
    for name, t in (("z", z), ("x_s", x_s), ("rms_weight", rms_weight)):
        if t.dtype != torch.bfloat16:
            return f"MegaMoE needs {name} in bfloat16, got {t.dtype}"
    m, latent = z.shape
    num_experts, two_inter, _ = w13.shape
    want = {
        "experts": (num_experts, state.num_experts), "latent": (latent, state.latent),
        "inter": (two_inter // 2, state.inter), "top_k": (topk_ids.shape[1], state.top_k),
        "hidden": (x_s.shape[1], state.hidden), "shared_inter": (w1_s.shape[0], state.shared_inter),
    }
    for what, (got, prepared) in want.items():
        if got != prepared:
            return f"{what} = {got} but the MegaMoE workspace was prepared for {prepared}"
    return state.capacity_reason(m)


@dataclass
class Launched:
    y: torch.Tensor
    ws: torch.Tensor | None  # local mode: already complete
    m: int


def launch(state: ProducerState, args: tuple) -> Launched:
    """Stage inputs into the symmetric buffer and launch the kernel (remote stores in flight)."""
    (z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, _fmt, beta, lin_beta,
     rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, _group) = args
    dg = deep_gemm_module()
    routed = routed_weights(w13, w2, w13_scale, w2_scale)
    shared = shared_weights(w1_s, w3_s, w2_s)
    m = z.shape[0]
    buf = state.sym_buffer
    x_fp8, x_sf = quantize_fp8_ue8m0(z)
    buf.x[:m].copy_(x_fp8)
    buf.x_sf[:m].copy_(x_sf)
    ids = topk_ids.long()
    buf.topk_idx[:m].copy_(torch.where(ids >= 0, ids + state.rank * state.num_experts, torch.full_like(ids, -1)))
    buf.topk_weights[:m].copy_(topk_weights)
    y = torch.empty_like(z)
    common = dict(
        y=y, l1_weights=routed.l1, l2_weights=routed.l2, shared_x=x_s, shared_l1_weights=shared.l1,
        shared_l2_weights=shared.l2, rms_weight=rms_weight, rms_epsilon=float(eps), sym_buffer=buf,
        activation="situ", situ_beta=float(beta), situ_linear_beta=float(lin_beta),
    )
    state.calls += 1
    if mode == "local":
        ws = torch.empty((1, x_s.shape[0], x_s.shape[1]), dtype=x_s.dtype, device=x_s.device)
        dg.fp8_fp4_mega_moe_bf16_shared(shared_y=ws[0], **common)
        return Launched(y, ws, m)
    pub = state.publish
    publish = dg.fp8_fp4_mega_moe_bf16_shared_rs if mode == "hidden_scatter" else dg.fp8_fp4_mega_moe_bf16_shared_sp_rs
    publish(shared_rs_workspace=pub.tensor, shared_rs_flags=pub.flags, shared_rs_peer_ptrs=pub.peer_ptrs, **common)
    return Launched(y, None, m)


def collect(state: ProducerState, launched: Launched) -> tuple[torch.Tensor, torch.Tensor]:
    """After every rank launched: read this rank's fragments out of the current generation.

    The generation index lives on the device (flags[0]) and advances there, so a captured CUDA
    graph replays correctly; every rank advances it once per call, in lockstep. A peer can run at
    most one call ahead (the barrier of the next call needs us), so it writes the next
    generation while we read this one.
    """
    if launched.ws is not None:
        return launched.y, launched.ws
    pub = state.publish
    pub.barrier()
    m = launched.m
    flat = pub.tensor.view(pub.generations * pub.rows, *pub.tensor.shape[2:])
    rows = pub.flags[0:1].long() * pub.rows + torch.arange(m, device=flat.device)
    got = flat.index_select(0, rows)  # [M, R, cols]: token-major, as DeepGEMM writes it
    ws = got.transpose(0, 1).contiguous() if state.mode == "hidden_scatter" else got
    pub.flags[0:1].add_(1).remainder_(pub.generations)
    return launched.y, ws


def producer_deepgemm(*args) -> tuple[torch.Tensor, torch.Tensor]:
    mode, group_name = args[16], args[17]
    state = state_for(group_name, mode)
    return collect(state, launch(state, args))
