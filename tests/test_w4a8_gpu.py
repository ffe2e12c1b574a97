"""The W4A8 prefill kernels on the GPU (sm_90): the activation quantiser bit for bit against its definition, L1 and L2
against the float64 form of the W4A8 definition (ops/routed/w4a8_numerics.py) at every kernel shape (full, half-empty
and one-row blocks, unused blocks, gate/up and L2 tiles, Kimi K3's L and I), poisoned outputs, the routed op with
LMF_ROUTED_W4A8=1 against both float64 forms, a CUDA graph replay, and bad inputs."""

import pytest
import torch

from latent_moe_fusion import tuning
from latent_moe_fusion.ops.common.mxfp4 import quantize_mxfp4
from latent_moe_fusion.ops.routed.triton.moe_align import group_by_expert
from latent_moe_fusion.ops.routed.w4a8_numerics import (
    ACT_BLOCK,
    blockwise_matmul64,
    expand_mxfp4_to_e4m3,
    quantize_activations,
    routed_experts64,
)
from latent_moe_fusion.ops.routed.w4a8_path import W4A8_ROWS, launch_l1_w4a8, launch_l2_w4a8

pytestmark = pytest.mark.gpu
BETA, LIN_BETA = 4.0, 25.0
# The MMAs' sums (FP8 wgmma keeps fewer bits than FP32 inside a 128-k step) against float64, then one bf16 rounding
# (act) or none (pairs).
PAIRS_BOUND, ACT_BOUND, OUTPUT_BOUND = 5e-4, 4e-3, 4e-3
W4A8_VS_EXACT_BOUND = 6e-2  # docs/numerics.md


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the W4A8 kernels need an sm_90 GPU")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _weights(experts: int, latent: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, latent, generator=g) / latent**0.5
    w2 = torch.randn(experts, latent, inter, generator=g) / inter**0.5
    w13[:, :64] *= 8.0  # a row block with exponents 3 above its neighbours
    p13, s13 = quantize_mxfp4(w13)
    p2, s2 = quantize_mxfp4(w2)
    return [t.cuda() for t in (p13, s13, p2, s2)]


def _routing(m: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)]).to(torch.int32)
    ids[torch.rand(m, top_k, generator=g) < 0.2] = -1  # another rank's experts
    return ids.cuda(), torch.rand(m, top_k, generator=g).cuda()


@needs_sm90
@pytest.mark.parametrize("rows,k", [(5, 3584), (300, 3072), (64, 512)])
def test_the_quantiser_gives_the_definitions_bits(rows, k):
    x = (torch.randn(rows, k, device="cuda") * torch.logspace(-4, 4, k // ACT_BLOCK, device="cuda").repeat_interleave(
        ACT_BLOCK)).to(torch.bfloat16)
    x[1, :ACT_BLOCK] = 0
    from latent_moe_fusion.ops.routed.triton.quantize_1x128 import quantize_1x128

    values, scales = quantize_1x128(x)
    want_v, want_s = quantize_activations(x)
    assert torch.equal(values.view(torch.uint8), want_v.view(torch.uint8)) and torch.equal(scales, want_s)
    live = torch.arange(rows, dtype=torch.int32, device="cuda")
    live[::3] = -1
    values2, scales2 = quantize_1x128(x, live)
    kept = live >= 0
    assert torch.equal(values2[kept].view(torch.uint8), want_v[kept].view(torch.uint8))
    assert torch.equal(scales2[kept], want_s[kept])


def _layer_case(m: int, experts: int, top_k: int, latent: int, inter: int, seed: int):
    torch.manual_seed(seed)
    p13, s13, p2, s2 = _weights(experts, latent, inter, seed)
    ids, weights = _routing(m, experts, top_k, seed)
    z = torch.randn(m, latent, device="cuda").to(torch.bfloat16)
    grouping = group_by_expert(ids, experts, 128)
    return z, ids, weights, p13, s13, p2, s2, grouping


@needs_sm90
@pytest.mark.parametrize("rows", W4A8_ROWS)
@pytest.mark.parametrize("m,experts,top_k,latent,inter", [
    (700, 4, 2, 3584, 3072),  # Kimi K3's L and I; full, partial and (after 20 % dropped) uneven blocks
    (130, 6, 3, 1024, 512),  # blocks of one to a few rows, most half empty
    (3, 8, 2, 512, 1024),  # one-row blocks; unused blocks beyond the used ones
])
def test_l1_and_l2_match_the_definition_at_every_kernel_shape(m, experts, top_k, latent, inter, rows):
    with tuning.overrides(w4a8_rows=str(rows)):
        _check_layers(m, experts, top_k, latent, inter)


def _check_layers(m, experts, top_k, latent, inter):
    z, ids, weights, p13, s13, p2, s2, grouping = _layer_case(m, experts, top_k, latent, inter, m)
    sorted_pairs, block_expert = grouping.sorted_pairs, grouping.block_expert
    blocks = block_expert.numel()
    act = torch.full((blocks * 128, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    launch_l1_w4a8(z, p13, s13, sorted_pairs, block_expert, act, blocks, top_k, BETA, LIN_BETA)
    pairs = torch.full((m * top_k, latent), float("nan"), dtype=torch.float32, device="cuda")
    launch_l2_w4a8(act, p2, s2, sorted_pairs, block_expert, pairs, blocks)
    torch.cuda.synchronize()
    rows = sorted_pairs.long()
    valid = rows >= 0
    pair_ids = rows[valid]
    tok = pair_ids // top_k
    exp_of_row = block_expert.long().repeat_interleave(128)[valid]
    zq, zs = quantize_activations(z)
    act_want = torch.empty(pair_ids.numel(), inter, dtype=torch.float64, device="cuda")
    pairs_want = torch.empty(pair_ids.numel(), latent, dtype=torch.float64, device="cuda")
    act_rows = act[valid.nonzero().squeeze(1)]
    assert not act_rows.isnan().any(), "L1 left act rows of valid pairs unwritten"
    for e in exp_of_row.unique().tolist():
        sel = exp_of_row == e
        h = blockwise_matmul64(zq[tok[sel]], zs[tok[sel]], *expand_mxfp4_to_e4m3(p13[e], s13[e])).float()
        g, u = h[:, :inter].double(), h[:, inter:].double()
        act_want[sel] = (BETA * torch.tanh(g / BETA) * torch.sigmoid(g)) * (LIN_BETA * torch.tanh(u / LIN_BETA))
        aq, a_s = quantize_activations(act_rows[sel])  # L2 against its own input: the act rows L1 wrote
        pairs_want[sel] = blockwise_matmul64(aq, a_s, *expand_mxfp4_to_e4m3(p2[e], s2[e]))
    assert _rel(act_rows, act_want) < ACT_BOUND
    got_pairs = pairs[pair_ids]
    assert not got_pairs.isnan().any(), "L2 left pair rows unwritten"
    assert _rel(got_pairs, pairs_want) < PAIRS_BOUND
    dropped = torch.ones(m * top_k, dtype=torch.bool, device="cuda")
    dropped[pair_ids] = False
    assert pairs[dropped].isnan().all(), "L2 wrote rows of pairs it does not hold"


@needs_sm90
@pytest.mark.parametrize("m", [2048, 3000])
def test_the_routed_op_on_w4a8_matches_both_float64_forms(m, monkeypatch):
    import latent_moe_fusion  # noqa: F401
    from latent_moe_fusion.ops.routed.routed_plan import plan_call

    experts, top_k, latent, inter = 8, 4, 3584, 3072  # 1000+ rows per expert: the 128-row staged blocks
    z, ids, weights, p13, s13, p2, s2, _ = _layer_case(m, experts, top_k, latent, inter, m + 1)
    monkeypatch.setenv("LMF_ROUTED_W4A8", "1")
    plan = plan_call(z, ids, p13, p2, s13, s2, "mxfp4")
    assert plan.family == "staged" and plan.w4a8, plan.lines()
    y = torch.ops.lmf.routed_experts(z, ids, weights, p13, p2, s13, s2, "mxfp4", BETA, LIN_BETA)
    w4a8 = routed_experts64(z, ids, weights, p13, p2, s13, s2, BETA, LIN_BETA, w4a8=True)
    exact = routed_experts64(z, ids, weights, p13, p2, s13, s2, BETA, LIN_BETA, w4a8=False)
    assert _rel(y, w4a8) < OUTPUT_BOUND
    assert _rel(y, exact) < W4A8_VS_EXACT_BOUND
    graph = torch.cuda.CUDAGraph()
    out = {}
    with torch.cuda.graph(graph):
        out["y"] = torch.ops.lmf.routed_experts(z, ids, weights, p13, p2, s13, s2, "mxfp4", BETA, LIN_BETA)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out["y"], y)
    monkeypatch.delenv("LMF_ROUTED_W4A8")
    y_bf16 = torch.ops.lmf.routed_experts(z, ids, weights, p13, p2, s13, s2, "mxfp4", BETA, LIN_BETA)
    assert not torch.equal(y_bf16, y) and _rel(y_bf16, exact) < 1e-2  # default numerics unchanged: the BF16 path


@needs_sm90
def test_bad_inputs_say_what_is_wrong():
    z, ids, weights, p13, s13, p2, s2, grouping = _layer_case(40, 4, 2, 640, 512, 7)
    act = torch.empty(grouping.block_expert.numel() * 128, 512, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="K = 640 must be a multiple of 512"):
        launch_l1_w4a8(z, p13, s13, grouping.sorted_pairs, grouping.block_expert, act, 1, 2, BETA, LIN_BETA)
    with pytest.raises(ValueError, match="activations must be bfloat16"):
        launch_l1_w4a8(z.float(), p13, s13, grouping.sorted_pairs, grouping.block_expert, act, 1, 2, BETA, LIN_BETA)


@needs_sm90
@pytest.mark.parametrize("rows", W4A8_ROWS)
@pytest.mark.parametrize("which", ["l1", "l2"])
def test_exact_operands_give_the_exact_sums(which, rows):
    with tuning.overrides(w4a8_rows=str(rows)):
        _check_exact(which)


def _check_exact(which):
    """Operands whose every partial sum is a short binary number (small integers, e2m1 codes, unit scales, 448 in
    each 128-block on a zero weight to pin the activation scale at 1): the kernel's sums must equal float64's, so a
    wrong byte, block or scale anywhere shows, apart from any rounding."""
    experts, top_k, m, latent, inter = 3, 2, 200, 1024, 512
    k, n = (latent, 2 * inter) if which == "l1" else (inter, latent)
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8)
    codes[:, :, ::64] &= 0xF0  # code 0 (k = 0 of every 128-block) is +0
    packed = codes.cuda()
    scales = torch.full((experts, n, k // 32), 127, dtype=torch.uint8, device="cuda")
    x = torch.randint(-2, 3, (m, k), generator=g).float()
    x[:, ::128] = 448.0
    ids, weights = _routing(m, experts, top_k, 5)
    grouping = group_by_expert(ids, experts, 128)
    blocks = grouping.block_expert.numel()
    valid = grouping.sorted_pairs.long() >= 0
    pair_ids = grouping.sorted_pairs.long()[valid]
    exp_of_row = grouping.block_expert.long().repeat_interleave(128)[valid]
    from latent_moe_fusion.ops.common.mxfp4 import dequantize_mxfp4

    if which == "l1":
        z = x.to(torch.bfloat16).cuda()
        act = torch.full((blocks * 128, inter), float("nan"), dtype=torch.bfloat16, device="cuda")
        launch_l1_w4a8(z, packed, scales, grouping.sorted_pairs, grouping.block_expert, act, blocks, top_k, BETA,
                       LIN_BETA)
        torch.cuda.synchronize()
        got = act[valid.nonzero().squeeze(1)].double()
        want = torch.empty_like(got)
        tok = pair_ids // top_k
        for e in exp_of_row.unique().tolist():
            sel = exp_of_row == e
            h = (z[tok[sel]].double() @ dequantize_mxfp4(packed[e], scales[e], torch.float64).t()).float().double()
            gg, uu = h[:, :inter], h[:, inter:]
            want[sel] = ((BETA * torch.tanh(gg / BETA) * torch.sigmoid(gg)) * (LIN_BETA * torch.tanh(uu / LIN_BETA))
                         ).to(torch.bfloat16).double()
        # SiTU in FP32 (the kernel) against float64 may round a value to the neighbouring bf16: never further.
        mismatch = (got != want).float().mean().item()
        assert mismatch < 0.05 and ((got - want).abs() <= want.abs() * 2**-7 + 1e-30).all(), f"{mismatch:.2%}"
    else:
        act = torch.full((blocks * 128, k), float("nan"), dtype=torch.bfloat16, device="cuda")
        held = int(valid.sum())  # rows holding a pair: x's rows, repeated as needed
        act[valid.nonzero().squeeze(1)] = x.repeat(-(-held // m), 1)[:held].to(torch.bfloat16).cuda()
        pairs = torch.full((m * top_k, n), float("nan"), dtype=torch.float32, device="cuda")
        launch_l2_w4a8(act, packed, scales, grouping.sorted_pairs, grouping.block_expert, pairs, blocks)
        torch.cuda.synchronize()
        rows = act[valid.nonzero().squeeze(1)].double()
        want = torch.empty(rows.shape[0], n, dtype=torch.float64, device="cuda")
        for e in exp_of_row.unique().tolist():
            sel = exp_of_row == e
            want[sel] = rows[sel] @ dequantize_mxfp4(packed[e], scales[e], torch.float64).t()
        got = pairs[pair_ids].double()
        assert torch.equal(got, want), f"{(got != want).float().mean():.2%} of pair sums differ, largest " \
                                       f"{(got - want).abs().max().item()}"
