"""Prefill where int32 element offsets end (pytest -m gpu; sized for one H200's 141 GB): one EP8 rank of Kimi K3
(H = 7168, L = 3584, 112 MXFP4 experts of I = 3072, top-16, shared 768).

M = 32768: the fused block is rewritten by the pass (its tail was refused for a split-K workspace the launcher never
allocates there), the tail and the routed op agree with float64. Past int32 (ops/common/element_offsets.py): the
tail with sequence-parallel fragments [M, 8, H] of 2.2e9 elements, the routed op at M = 65536 (FP32 pair rows
[1048576, 3584], activation rows and the kappa kernels' gathered z rows past int32) on the kappa kernels (the
default), on the staged kernels and on the Triton tiles under LARGE_OFFSETS. The routed problems hold ROUTED_EXPERTS = 16 experts, every token on all of them: the same pairs and
rows as the rank's 112 experts with every pair local, at a seventh of the weights (quantising 112 experts' weights
at once took 74 GiB). Inputs are fresh random ones, outputs poisoned with NaN first."""

from __future__ import annotations

import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.ops.common.element_offsets import needs_int64_offsets
from latent_moe_fusion.ops.common.tail_gemm import tail_launch
from latent_moe_fusion.ops.routed import expert_schedule
from latent_moe_fusion.ops.routed.expert_schedule import run_experts
from latent_moe_fusion.ops.tail.triton import triton_tail_backend
from tests.expert_problems import make_problem, rel_l2, tolerance
from tests.float64_reference import routed64
from tests.launch_spy import LaunchSpy
from tests.regs_gpu import SM90_ONLY

pytestmark = SM90_ONLY

H, L, INTER, EXPERTS, TOP_K = 7168, 3584, 3072, 112, 16
ROUTED_EXPERTS = 16  # the routed problems' experts: top-16 of 16, every pair local
BF16_TOL = 1e-2  # a bf16 tail against float64 (tests/test_tail_gpu.py)


def _tail_ref64(a: torch.Tensor, w: torch.Tensor, frags: torch.Tensor) -> torch.Tensor:
    acc = a.double() @ w.double().t()
    for r in range(frags.shape[0]):
        acc += frags[r].double()
    return acc


def _tail_operands(m: int, frag_shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.randn(m, L, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(H, L, device="cuda") / L**0.5).to(torch.bfloat16)
    return a, w, torch.randn(frag_shape, dtype=torch.bfloat16, device="cuda")


def _tail_checked(a, w, frags, monkeypatch) -> list[bool]:
    """tail_fused into a poisoned output against float64; the LARGE_OFFSETS of its launches."""
    seen: list[bool] = []
    for kernel in ("tail_tile_kernel", "tail_tile_tma_kernel"):
        monkeypatch.setattr(tail_launch, kernel, LaunchSpy(getattr(tail_launch, kernel), "LARGE_OFFSETS", seen))
    out = tail_launch.tail_fused(a, w, frags, out=torch.full((a.shape[0], w.shape[0]), float("nan"),
                                                              dtype=a.dtype, device="cuda"))
    assert not out.isnan().any(), "unwritten output elements"
    ref = _tail_ref64(a, w, frags)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < BF16_TOL, f"M = {a.shape[0]}, R = {frags.shape[0]}: rel L2 {err:.3g}"
    return seen


def test_tail_at_32768_takes_the_triton_tail(monkeypatch, rng_seed):
    a, w, ws = _tail_operands(32768, (1, 32768, H))
    assert triton_tail_backend.supports(a, w, ws, "local") is None
    assert _tail_checked(a, w, ws, monkeypatch) == [False]  # every tensor within int32 offsets


def test_tail_with_fragments_past_int32(monkeypatch, rng_seed):
    m = 2**31 // (8 * H) + 37  # sequence parallel over 8 ranks: the last tokens' fragments lie past int32
    a, w, ws = _tail_operands(m, (m, 8, H))
    frags = ws.transpose(0, 1)
    assert needs_int64_offsets(frags) and triton_tail_backend.supports(a, w, ws, "token_publish") is None
    assert _tail_checked(a, w, frags, monkeypatch) == [True]


def _all_local_problem(m: int):
    """A routed problem with every (token, slot) pair on a local expert: the largest rows any routing writes. Each
    token takes the ROUTED_EXPERTS experts in its own random slot order."""
    p = make_problem(m, latent=L, inter=INTER, num_experts=ROUTED_EXPERTS, top_k=TOP_K, hidden=64, inter_s=32,
                     weight_format="mxfp4", routing="none", device="cuda")
    p.topk_ids.copy_(torch.rand(m, ROUTED_EXPERTS, device="cuda").argsort(dim=1)[:, :TOP_K].to(torch.int32))
    return p


def _routed(p, tuned, rows) -> torch.Tensor:
    tuned(prefill_regs=rows)
    return run_experts(*p.routed_args(), out=torch.full_like(p.z, float("nan")))


def test_routed_op_at_32768(tuned, rng_seed):
    p = _all_local_problem(32768)
    y = _routed(p, tuned, None)  # the default: the kappa kernels
    assert torch.isfinite(y).all()
    assert rel_l2(y, routed64(*p.routed_args())) < tolerance(torch.bfloat16)


def test_routed_op_at_65536_past_int32(tuned, monkeypatch, rng_seed):
    p = _all_local_problem(65536)
    ref = routed64(*p.routed_args())
    seen: list[bool] = []
    for kernel in ("l1_kernel", "l2_kernel"):
        monkeypatch.setattr(expert_schedule, kernel, LaunchSpy(getattr(expert_schedule, kernel), "LARGE_OFFSETS", seen))
    # the kappa and the staged kernels (int64 rows always), the Triton tiles (LARGE_OFFSETS)
    for rows, kernel in ((None, "kappa"), (None, "staged"), (0, None)):
        tuned(staged_kernel=kernel)
        y = _routed(p, tuned, rows)
        assert torch.isfinite(y).all(), (rows, kernel)
        assert rel_l2(y, ref) < tolerance(torch.bfloat16), (rows, kernel)
    assert seen == [True, True]  # the Triton tiles' L1 and L2, activation rows past int32


def test_compiled_block_is_fused_at_32768(rng_seed):
    cfg = lmf.KimiK3MoEConfig().replace(shared_intermediate_size=768)
    block = lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cuda", seed=0, ep_size=8,
                               ep_rank=0)
    fpass = lmf.LatentMoEFusionPass()
    torch._dynamo.reset()
    fn = torch.compile(block, options={"post_grad_custom_pre_pass": fpass, "fx_graph_cache": False}, dynamic=False)
    x = torch.randn(32768, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    out = fn(x)
    assert fpass.report.matched == 1 and not fpass.report.rejected, fpass.report.summary()
    assert torch.isfinite(out).all()
    assert rel_l2(out, block(x)) < 1.5e-2
