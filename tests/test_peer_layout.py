"""The peer comparison's plumbing (bench/peer_*.py, bench/serving_baseline.py) on the CPU.

Without the peer's source: the transposition and gate/up interleave against our decoder, the SiTU activation of its
fused-activation hook (Triton interpreter) against float64, the routing packing, and the serving baseline's block
wrapper. With it (.peer/python/triton_kernels; CI has none, those tests skip): our bytes in its Hopper layouts
decoded by its own `upcast_from_mxfp_torch` bit for bit, and its routing metadata built from our ids.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import latent_moe_fusion as lmf
from bench.peer_layout import HOW_TO_GET_FOR_TESTS, interleave_gate_up, to_kn, use_triton_kernels
from bench.peer_routing import pack_routing
from bench.peer_situ import situ_pairs
from latent_moe_fusion.ops import dequantize_mxfp4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PEER_MISSING = use_triton_kernels()
needs_peer = pytest.mark.skipif(PEER_MISSING is not None, reason=f"peer source absent ({PEER_MISSING}); {HOW_TO_GET_FOR_TESTS}")
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def random_mxfp4(experts: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random codes [E, N, K/2] and E8M0 scales [E, N, K/32] in 1..250: every value finite in FP32 (from 251 on,
    6 * 2^(s - 127) overflows, which our decoder returns as inf and theirs clamps), and 0 and 255 decode differently
    on the two sides' reference decoders (2^-127 and NaN in ours, 0 and inf in theirs)."""
    values = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.randint(1, 251, (experts, n, k // 32), generator=gen, dtype=torch.uint8)
    return values, scales


def decode_kn(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Plain-torch decoder of the peer's [E, K/2, N] + [E, K/32, N] bytes (quantised along dim 1): byte j along K
    holds element 2j in its low nibble. Float64."""
    nibbles = torch.stack([values & 0xF, values >> 4], dim=2).flatten(1, 2).long()  # [E, K, N]
    magnitude = torch.tensor(E2M1, dtype=torch.float64)[nibbles & 7]
    signed = torch.where((nibbles & 8) > 0, -magnitude, magnitude)
    return signed * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=1)


@pytest.fixture
def gen(rng_seed) -> torch.Generator:
    return torch.Generator().manual_seed(rng_seed)


def test_interleave_and_transpose_keep_every_weight(gen):
    experts, inter, latent = 3, 64, 128
    w13, s13 = random_mxfp4(experts, 2 * inter, latent, gen)
    w2, s2 = random_mxfp4(experts, latent, inter, gen)
    ours13 = dequantize_mxfp4(w13, s13, torch.float64)  # [E, 2I, L]
    theirs13 = decode_kn(to_kn(interleave_gate_up(w13)), to_kn(interleave_gate_up(s13)))  # [E, L, 2I]
    assert torch.equal(theirs13[:, :, 0::2], ours13[:, :inter].transpose(1, 2))  # gate i in column 2i
    assert torch.equal(theirs13[:, :, 1::2], ours13[:, inter:].transpose(1, 2))  # up i in column 2i + 1
    assert torch.equal(decode_kn(to_kn(w2), to_kn(s2)), dequantize_mxfp4(w2, s2, torch.float64).transpose(1, 2))


def test_interleave_rejects_an_odd_row_count():
    with pytest.raises(ValueError, match="must be even"):
        interleave_gate_up(torch.zeros(2, 5, 4, dtype=torch.uint8))


@triton.jit
def _situ_rows(X, Y, beta, lin_beta, M: tl.constexpr, N: tl.constexpr):
    rows = tl.arange(0, M)
    acc = tl.load(X + rows[:, None] * N + tl.arange(0, N)[None, :])
    out = situ_pairs(acc, beta, lin_beta)
    tl.store(Y + rows[:, None] * (N // 2) + tl.arange(0, N // 2)[None, :], out)


def test_situ_pairs_matches_float64(gen):
    """The activation the peer's L1 applies to its FP32 tile: SiTU of each (gate, up) column pair."""
    beta, lin_beta = 4.0, 25.0
    acc = torch.randn(16, 64, generator=gen) * torch.tensor([3.0, 40.0]).repeat(32)  # up values reach tanh's tail
    acc[0, :4] = torch.tensor([0.0, 0.0, -1e-6, 1e-6])
    out = torch.empty(16, 32, device=DEVICE)
    _situ_rows[(1,)](acc.to(DEVICE), out, beta, lin_beta, M=16, N=64)
    g, u = acc[:, 0::2].double(), acc[:, 1::2].double()
    expected = (beta * torch.tanh(g / beta) * torch.sigmoid(g)) * (lin_beta * torch.tanh(u / lin_beta))
    assert ((out.cpu().double() - expected).norm() / expected.norm()).item() < 1e-6
    # elementwise: FP32 with our kernels' tanh (exp-based: near 0 its error is a few FP32 ulps of 1, not of tanh)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-4, atol=1e-6)


def test_pack_routing_skips_every_id_outside_the_rank(gen):
    experts, m, top_k = 40, 7, 5
    ids = torch.stack([torch.randperm(experts + 8, generator=gen)[:top_k] for _ in range(m)]).to(torch.int32) - 4
    ids[0, 0] = -1  # ids below 0 (other ranks) and >= E (never from our op: mapped all the same)
    weights = torch.rand(m, top_k, generator=gen)
    ids16, weights16, bits = pack_routing(ids.to(DEVICE), weights.to(DEVICE), experts)
    local = (ids >= 0) & (ids < experts)
    assert torch.equal(ids16.cpu(), torch.where(local, ids, -1).to(torch.int16))
    assert torch.equal(weights16.cpu()[~local], torch.full((int((~local).sum()),), -1.0, dtype=torch.bfloat16))
    torch.testing.assert_close(weights16.cpu()[local].float(), weights[local], rtol=2**-7, atol=0)  # one BF16 rounding
    words = bits.cpu().view(torch.int32).long() & 0xFFFFFFFF
    expected = torch.zeros(m, bits.shape[1], dtype=torch.long)
    for row, expert in zip(*torch.nonzero(local, as_tuple=True), strict=True):
        e = int(ids[row, expert])
        expected[row, e // 32] |= 1 << (e % 32)
    assert torch.equal(words, expected)


def _tiny_rank_block() -> lmf.KimiK3MoEBlock:
    cfg = lmf.KimiK3MoEConfig.tiny()
    return lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.float32, seed=3, ep_size=2, ep_rank=1)


def test_serving_block_is_the_block_with_its_routed_call_swapped():
    """With the reference op in place of the peer, the serving block computes what the block computes: eagerly bit for
    bit, compiled (torch.compile, the op opaque) within FP32 reordering."""
    from bench.serving_baseline import serving_block

    block = _tiny_rank_block()
    calls = []

    def reference(z, ids, weights):
        calls.append(ids.clone())
        return torch.ops.lmf.routed_experts(z, ids, weights, block.w13, block.w2, block.w13_scale, block.w2_scale,
                                            "mxfp4", block.cfg.situ_beta, block.cfg.situ_linear_beta)

    x = torch.randn(5, block.cfg.hidden_size)
    expected = block(x)
    assert torch.equal(serving_block(block, routed=reference, compiled=False)(x), expected)
    assert calls and int(calls[0].max()) < block.num_local_experts and bool((calls[0] < 0).any())  # ids localised
    torch.testing.assert_close(serving_block(block, routed=reference)(x), expected, rtol=1e-4, atol=1e-5)


@needs_peer
def test_to_peer_layout_is_bit_exact_against_their_decoder(gen):
    """Our bytes through to_peer_layout (interleave, [E, K, N], Hopper swizzles), unswizzled and decoded by the peer's
    own upcast_from_mxfp_torch, are our dequantised weights exactly (gate/up interleaved, transposed)."""
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch

    from bench.peer_layout import peer_bytes, to_peer_layout

    experts, inter, latent = 3, 64, 128
    w13, s13 = random_mxfp4(experts, 2 * inter, latent, gen)
    w2, s2 = random_mxfp4(experts, latent, inter, gen)
    peer = to_peer_layout(w13, s13, w2, s2)
    assert (peer.num_experts, peer.latent, peer.inter) == (experts, latent, inter)
    assert list(peer.w13.shape) == [experts, latent, 2 * inter] and list(peer.w2.shape) == [experts, inter, latent]
    assert peer.w13.stride(-2) == 1 and peer.w2.stride(-2) == 1  # what matmul_ogs asserts for MX weights on Hopper
    theirs13 = upcast_from_mxfp_torch(peer_bytes(peer.w13), peer_bytes(peer.w13_precision.weight_scale),
                                      torch.float32, axis=1)
    ours13 = dequantize_mxfp4(w13, s13, torch.float32)
    assert torch.equal(theirs13[:, :, 0::2], ours13[:, :inter].transpose(1, 2))
    assert torch.equal(theirs13[:, :, 1::2], ours13[:, inter:].transpose(1, 2))
    theirs2 = upcast_from_mxfp_torch(peer_bytes(peer.w2), peer_bytes(peer.w2_precision.weight_scale),
                                     torch.float32, axis=1)
    assert torch.equal(theirs2, dequantize_mxfp4(w2, s2, torch.float32).transpose(1, 2))


@needs_peer
def test_peer_routing_holds_our_token_expert_weight_triples(gen):
    """Their routing metadata, built by their kernels (interpreted on the CPU) from our ids with other ranks' experts at
    -1: the same (token, expert, weight) triples as ours, sorted by expert, each skipped slot unscattered."""
    from bench.peer_routing import make_peer_routing

    experts, m, top_k = 40, 9, 8  # their metadata kernels need a power-of-2 top-k (Kimi's 16 is one)
    ids = torch.stack([torch.randperm(2 * experts, generator=gen)[:top_k] for _ in range(m)]).to(torch.int32)
    ids = torch.where(ids < experts, ids, -1)  # the other half belongs to another rank
    ids[3] = -1  # a token with no local expert
    weights = torch.rand(m, top_k, generator=gen)
    routing, gather, scatter = make_peer_routing(ids.to(DEVICE), weights.to(DEVICE), experts)
    by_expert, by_slot = gather.src_indx.cpu().long(), scatter.src_indx.cpu().long()
    sizes = routing.expt_hist.cpu().long()
    local = ids >= 0
    pairs = int(local.sum())
    assert torch.equal(sizes[:experts], torch.bincount(ids[local].long(), minlength=experts))
    assert int(sizes[experts:].sum()) == 0 and routing.n_expts_tot == experts and routing.n_expts_act == top_k
    expert_of_row = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    flat = by_expert[:pairs]
    assert bool((by_expert[pairs:] == -1).all())
    assert torch.equal(ids.reshape(-1)[flat].long(), expert_of_row)  # each sorted row is its expert's pair
    theirs = sorted(zip((flat // top_k).tolist(), expert_of_row.tolist(), strict=True))
    ours = sorted(zip(torch.nonzero(local, as_tuple=True)[0].tolist(), ids[local].tolist(), strict=True))
    assert theirs == ours  # (token, expert) pairs; their weights, row by row:
    torch.testing.assert_close(routing.gate_scal.cpu()[:pairs].float(), weights.reshape(-1)[flat], rtol=2**-7, atol=0)
    assert torch.equal(by_slot[flat], torch.arange(pairs)) and bool((by_slot[~local.reshape(-1)] == -1).all())
    assert torch.equal(scatter.dst_indx.cpu(), gather.src_indx.cpu()) and torch.equal(gather.dst_indx.cpu(),
                                                                                      scatter.src_indx.cpu())


@needs_peer
def test_peer_routing_through_their_torch_reference_is_our_op(gen, monkeypatch):
    """Their own torch reference of matmul_ogs (matmul_ogs_torch) on our routing data and gate/up-interleaved
    weights, SiTU between L1 and L2, computes our op's sum: the gather, the per-expert rows, the (gate, up) pairs, the
    gammas and the scatter mean what we mean. FP32 gammas here (their BF16 ones are checked against our weights in
    the triples test): within FP32 rounding of float64."""
    from triton_kernels.matmul_ogs import matmul_ogs_torch

    from bench.peer_inputs import RankInputs, rank_weights, routed_float64
    from bench.peer_routing import make_peer_routing

    if DEVICE == "cpu":  # it builds an unused index tensor on "cuda" for its rounding hook
        arange = torch.arange
        monkeypatch.setattr(torch, "arange", lambda *args, device=None, **kwargs: arange(*args, **kwargs))
    experts, latent, inter, m, top_k = 5, 128, 64, 7, 8
    w = rank_weights(gen, "cpu", num_experts=experts, latent=latent, inter=inter)
    ids = torch.stack([torch.randperm(2 * experts, generator=gen)[:top_k] for _ in range(m)]).to(torch.int32)
    s = RankInputs(torch.randn(m, latent, generator=gen).to(torch.bfloat16), torch.where(ids < experts, ids, -1),
                   torch.rand(m, top_k, generator=gen))
    routing, gather, scatter = make_peer_routing(s.ids.to(DEVICE), s.weights.to(DEVICE), experts)
    slices = routing.expt_hist.numel()  # their reference walks every slice of the (32-wide) bitmatrix

    def kn(values, scales):  # [E, K, N] float32, padded with empty experts up to the slices
        dense = dequantize_mxfp4(values, scales).transpose(1, 2)
        return torch.cat([dense, dense.new_zeros(slices - experts, *dense.shape[1:])]).to(DEVICE)

    h = matmul_ogs_torch(s.z.float().to(DEVICE), kn(interleave_gate_up(w["w13"]), interleave_gate_up(w["w13_scale"])),
                         None, routing, gather_indx=gather)
    g, u = h[:, 0::2], h[:, 1::2]
    act = (4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g)) * (25.0 * torch.tanh(u / 25.0))
    gammas = s.weights.to(DEVICE).reshape(-1)[gather.src_indx.long()]  # the FP32 weight of each sorted row
    y = matmul_ogs_torch(act, kn(w["w2"], w["w2_scale"]), None, routing, scatter_indx=scatter, gammas=gammas)
    ref = routed_float64(s, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])
    assert ((y.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5
