"""Ours against the peer (OpenAI's triton_kernels MXFP4 MoE as vLLM runs it on sm_90) on the GPU (pytest -m gpu):
both sides on the same bytes, z, ids and weights at Kimi K3's expert sizes, each against float64 and against each
other; replayed from a CUDA graph; and the serving baseline of a small block against the block. Skipped without an
sm_90 GPU or without the peer's source (.peer/python/triton_kernels)."""

from __future__ import annotations

import pytest
import torch

import latent_moe_fusion as lmf
from bench.common import capture_graph, rel_l2
from bench.peer_inputs import BETA, LIN_BETA, RankInputs, rank_weights, routed_float64
from bench.peer_layout import HOW_TO_GET_FOR_TESTS, use_triton_kernels

PEER_MISSING = use_triton_kernels()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the peer is set up as vLLM sets it up on sm_90 (Hopper layouts)"),
    pytest.mark.skipif(PEER_MISSING is not None, reason=f"peer source absent ({PEER_MISSING}); {HOW_TO_GET_FOR_TESTS}"),
]

EXPERTS, TOP_K = 16, 16
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def rank():
    from bench.peer_moe import PeerRoutedExperts

    gen = torch.Generator(device="cuda").manual_seed(7)
    w = rank_weights(gen, "cuda", num_experts=EXPERTS)
    return w, PeerRoutedExperts(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], BETA, LIN_BETA)


def _inputs(m: int) -> RankInputs:
    """Distinct ids per token, about half of them -1 (experts of other ranks), one token with none local."""
    ids = torch.stack([torch.randperm(2 * EXPERTS)[:TOP_K] for _ in range(m)]).to(torch.int32)
    ids = torch.where(ids < EXPERTS, ids, -1)
    ids[m // 2] = -1
    z = torch.randn(m, 3584).to(torch.bfloat16)
    return RankInputs(z.cuda(), ids.cuda(), torch.rand(m, TOP_K).cuda())


def _ours(w, s: RankInputs) -> torch.Tensor:
    return torch.ops.lmf.routed_experts(s.z, s.ids, s.weights, w["w13"], w["w2"], w["w13_scale"], w["w2_scale"],
                                        "mxfp4", BETA, LIN_BETA)


@pytest.mark.parametrize("m", [8, 128])
def test_peer_and_ours_agree_with_float64_and_each_other(rank, m):
    w, peer = rank
    s = _inputs(m)
    ref = routed_float64(s, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
    ours, theirs = _ours(w, s), peer(s.z, s.ids, s.weights)
    assert theirs.shape == ours.shape and theirs.dtype == torch.bfloat16
    assert not theirs[m // 2].any() and not ours[m // 2].any()  # no local expert: zeros on both sides
    assert rel_l2(ours, ref) < TOLERANCE
    assert rel_l2(theirs, ref) < TOLERANCE
    assert rel_l2(theirs, ours) < TOLERANCE
    hinted = peer.with_hint(max(1, int((s.ids >= 0).sum()) // EXPERTS))(s.z, s.ids, s.weights)
    assert rel_l2(hinted, ref) < TOLERANCE


def test_peer_replays_from_a_cuda_graph(rank):
    """Routing data built inside the graph: a replay on new ids and weights gives the eager result for them."""
    w, peer = rank
    first, second = _inputs(32), _inputs(32)
    slot = RankInputs(first.z.clone(), first.ids.clone(), first.weights.clone())
    out = {}
    graph = capture_graph(lambda i: out.__setitem__("y", peer(slot.z, slot.ids, slot.weights)), 1)
    for s in (first, second):
        slot.z.copy_(s.z)
        slot.ids.copy_(s.ids)
        slot.weights.copy_(s.weights)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out["y"], peer(s.z, s.ids, s.weights))


def test_serving_block_matches_the_block():
    """The serving baseline (peer routed experts, the rest compiled) of a small EP block against the block."""
    from bench.serving_baseline import serving_block

    cfg = lmf.KimiK3MoEConfig().replace(hidden_size=1024, latent_size=512, num_experts=32, top_k=8,
                                        moe_intermediate_size=256, shared_intermediate_size=256)
    block = lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", device="cuda", seed=1, ep_size=2, ep_rank=1,
                               router_gemm="bf16")
    x = torch.randn(64, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert rel_l2(serving_block(block)(x), block(x)) < TOLERANCE
