"""Triton routed experts at tiny sizes (TRITON_INTERPRET=1 on CPU, native on a GPU)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from latent_moe_fusion.ops.mxfp4 import dequantize_mxfp4
from latent_moe_fusion.ops.triton_kernels.expert_schedule import run_experts
from latent_moe_fusion.ops.triton_kernels.moe_align import group_by_expert, max_blocks
from latent_moe_fusion.ops.triton_kernels.weight_tiles import e2m1_to_fp32, e8m0_to_fp32
from tests.expert_problems import make_problem, make_routing, rel_l2, tolerance

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


@pytest.mark.parametrize("m,top_k", [(21, 4), (1, 16), (3, 4)])
@pytest.mark.parametrize("kind", ["random", "one_expert", "none"])
def test_group_by_expert_places_every_pair_once(kind, m, top_k, rng_seed):
    num_experts, bm = 32, 16
    ids = make_routing(m, num_experts, top_k, kind, DEVICE)
    if m == 1 and kind == "random":
        ids[0, 1] = num_experts + 3  # out of range: no row, like an id of another rank's expert
    g = group_by_expert(ids, num_experts, bm)
    assert g.nb_max == max_blocks(m * top_k, num_experts, bm)
    rows = g.sorted_pairs.cpu().view(g.nb_max, bm)
    owners = g.block_expert.cpu()
    flat = ids.cpu().view(-1)
    placed = rows[rows >= 0]
    valid = torch.nonzero((flat >= 0) & (flat < num_experts)).view(-1).int()
    assert torch.equal(placed.sort().values, valid)  # every valid pair exactly once, no -1 ids
    used = int((owners >= 0).sum())
    assert torch.all(owners[:used] >= 0) and torch.all(owners[used:] == -1)
    assert torch.all(owners[:used][1:] >= owners[:used][:-1])  # blocks in expert order
    for b in range(g.nb_max):
        members = rows[b][rows[b] >= 0].long()
        assert torch.all(flat[members] == owners[b])
        if b < used:
            assert members.numel() > 0
        else:
            assert members.numel() == 0


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
