"""Triton routed experts at tiny sizes (TRITON_INTERPRET=1 on CPU, native on a GPU)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from latent_moe_fusion.ops.common.mxfp4 import dequantize_mxfp4
from latent_moe_fusion.ops.routed.expert_schedule import run_experts
from latent_moe_fusion.ops.routed.triton.moe_align import ALIGN_CHUNK, align_chunk, group_by_expert, max_blocks
from latent_moe_fusion.ops.routed.triton.weight_tiles import e2m1_to_fp32, e8m0_to_fp32
from tests.expert_problems import make_problem, make_routing, rel_l2, tolerance
from tests.grouping_checks import assert_valid_grouping

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = dict(latent=64, inter=32, num_experts=8, top_k=4, hidden=64, inter_s=32)


@triton.jit
def _decode_kernel(codes_ptr, scales_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    values = e2m1_to_fp32(tl.load(codes_ptr + offs)) * e8m0_to_fp32(tl.load(scales_ptr + offs))
    tl.store(out_ptr + offs, values)


def test_e2m1_e8m0_decode_matches_dequantize(rng_seed):
    n = 256
    packed = torch.randint(0, 256, (n // 2,), dtype=torch.uint8)
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(n)
    block_scales = torch.randint(100, 150, (n // 32,), dtype=torch.uint8)
    out = torch.full((n,), float("nan"), device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), block_scales.repeat_interleave(32).to(DEVICE), out, N=n)
    ref = dequantize_mxfp4(packed[None], block_scales[None], torch.float32)[0]
    assert torch.equal(out.cpu(), ref)


@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("m,top_k", [(21, 4), (1, 16), (3, 4), (300, 8)])
@pytest.mark.parametrize("kind", ["random", "one_expert", "none"])
def test_group_by_expert_places_every_pair_once(kind, m, top_k, spread, rng_seed):
    num_experts, bm = 32, 16
    ids = make_routing(m, num_experts, top_k, kind, DEVICE)
    if m == 1 and kind == "random":
        ids[0, 1] = num_experts + 3  # out of range: no row, like an id of another rank's expert
    if m == 300:
        ids[7, :3] = torch.tensor([-1, num_experts, -5])  # another rank's experts: no rows
    g = group_by_expert(ids, num_experts, bm, spread=spread)
    assert g.nb_max == max_blocks(m * top_k, num_experts, bm)
    assert_valid_grouping(g, ids, num_experts)


def test_align_chunk_is_a_power_of_two_within_bounds():
    """The one-program grouping steps over the pairs' power of two, at least ALIGN_CHUNK[0] and at most [1]."""
    low, high = ALIGN_CHUNK
    assert [align_chunk(n) for n in (0, 1, low, low + 1, high - 1, high, high + 1, 8176)] == \
        [low, low, low, 2 * low, high, high, high, high]


CASES = [
    ("bf16", torch.bfloat16, "random", 5),
    ("mxfp4", torch.bfloat16, "random", 7),
    ("bf16", torch.float32, "few_experts", 6),
    ("mxfp4", torch.bfloat16, "one_expert", 37),
]


@pytest.mark.parametrize("weight_format,dtype,routing,m", CASES)
def test_routed_matches_reference(weight_format, dtype, routing, m, rng_seed):
    p = make_problem(m, weight_format=weight_format, dtype=dtype, routing=routing, device=DEVICE, **SIZES)
    out = torch.full_like(p.z, float("nan"))
    y = run_experts(*p.routed_args(), out=out)
    assert y is out
    err = rel_l2(y, p.reference_routed())
    assert err < tolerance(dtype), f"rel L2 {err:.3g}"


def test_routed_without_local_ids_is_zero(rng_seed):
    p = make_problem(9, routing="none", device=DEVICE, **SIZES)
    out = torch.full_like(p.z, float("nan"))
    y = run_experts(*p.routed_args(), out=out)
    assert torch.equal(y, torch.zeros_like(y))


@pytest.mark.gpu
def test_spread_grouping_equals_one_program_at_prefill_size(rng_seed):
    """M = 4096, top-16, one EP8 rank's 112 experts (7/8 of the ids -1): both groupings give the same
    blocks per expert and the same pairs per expert (the row order inside an expert may differ)."""
    num_experts, bm = 112, 128
    ids = torch.randint(0, 8 * num_experts, (4096, 16), device="cuda", dtype=torch.int32)
    ids = torch.where(ids < num_experts, ids, -1)
    one, spread = (group_by_expert(ids, num_experts, bm, spread=s) for s in (False, True))
    assert torch.equal(one.block_expert, spread.block_expert)
    flat = ids.view(-1).long()
    for g in (one, spread):
        rows = g.sorted_pairs.view(g.nb_max, bm)
        owner = g.block_expert.long()[:, None].expand_as(rows)
        keep = rows >= 0
        assert torch.equal(flat[rows[keep].long()], owner[keep])  # every row's pair has its block's expert
        assert torch.equal(rows[keep].sort().values, torch.nonzero(flat >= 0).view(-1).int())
