"""The identity the project rests on: latent_tail(moe_shared_producer(...)) == the unfused block's forward.

R = 1 in-process; R = 2 and 4 in real gloo processes, for both TP layouts (hidden_scatter with the
non-SP block, token_publish with sequence_parallel=True). The R-rank block must also compute the same
function as the R = 1 block built from the same seed, and the fused path must be bitwise deterministic.
"""

import pytest
import torch
import torch.distributed as dist

from latent_moe_fusion import KimiK3MoEBlock
from tests import multirank
from tests.float64_reference import rel_l2, shared64
from tests.op_inputs import TINY, fused_forward, fused_producer_args
from tests.op_inputs import shared_gate_up as shared_gate_up_views

BF16, FP32 = torch.bfloat16, torch.float32
TOL = {BF16: 1e-2, FP32: 1e-5}


def _x(tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, TINY.hidden_size, generator=gen).to(dtype)


@pytest.mark.parametrize("shared_gate_up", ["merged", "split"])
@pytest.mark.parametrize("dtype, weight_format", [(BF16, "bf16"), (FP32, "bf16"), (BF16, "mxfp4")], ids=["bf16", "fp32", "bf16-mxfp4"])
def test_identity_single_rank(rng_seed, dtype, weight_format, shared_gate_up):
    block = KimiK3MoEBlock(TINY, weight_format=weight_format, dtype=dtype, seed=rng_seed, shared_gate_up=shared_gate_up)
    x = _x(7, dtype, rng_seed)
    unfused = block(x)
    fused = fused_forward(block, x)
    assert fused.dtype == dtype and fused.shape == x.shape
    assert rel_l2(fused, unfused) <= TOL[dtype]
    assert torch.equal(fused_forward(block, x), fused)
    if shared_gate_up == "merged":  # the merged parameter goes in as two row-block views, not copies
        w1_s, w3_s = shared_gate_up_views(block)
        assert w1_s.untyped_storage().data_ptr() == block.shared_w13.untyped_storage().data_ptr()
        assert w3_s.data_ptr() == block.shared_w13[TINY.shared_intermediate_size :].data_ptr()


def _ws_expected(args: dict, world: int, rank: int) -> torch.Tensor:
    """This rank's fragments from docs/design.md's layout definition, with every rank's float64 partial."""
    partial = shared64(args["x_s"], args["w1_s"], args["w3_s"], args["w2_s"], args["beta"], args["lin_beta"])
    partials = [torch.empty_like(partial) for _ in range(world)]
    dist.all_gather(partials, partial)
    if args["mode"] == "hidden_scatter":
        cols = partial.shape[1] // world
        return torch.stack([p[:, rank * cols : (rank + 1) * cols] for p in partials])
    m = partial.shape[0] // world
    return torch.stack([p[rank * m : (rank + 1) * m] for p in partials], dim=1)


def identity_on_ranks(rank: int, world: int, seed: int) -> dict:
    """For each (dtype, weight_format) and layout: errors of fused vs unfused vs the R = 1 block."""
    cases = RANK_CASES[world]
    tokens = 3 * world  # SP: 3 tokens per rank
    report = {}
    for dtype, weight_format in cases:
        single = KimiK3MoEBlock(TINY, weight_format=weight_format, dtype=dtype, seed=seed)
        x = _x(tokens, dtype, seed)  # the same on every rank
        single_out = single(x)
        for sp in (False, True):
            block = KimiK3MoEBlock(
                TINY, tp_group=dist.group.WORLD, sequence_parallel=sp, weight_format=weight_format, dtype=dtype, seed=seed
            )
            x_rank = x.chunk(world)[rank] if sp else x
            reference = single_out.chunk(world)[rank] if sp else single_out
            unfused = block(x_rank)
            fused = fused_forward(block, x_rank)
            again = fused_forward(block, x_rank)
            args = fused_producer_args(block, x_rank)
            _, ws = torch.ops.lmf.moe_shared_producer(**args)
            gathered = [torch.empty_like(fused) for _ in range(world)]
            dist.all_gather(gathered, fused)
            report[(str(dtype), weight_format, "token_publish" if sp else "hidden_scatter")] = {
                "fused_vs_unfused": rel_l2(fused, unfused),
                "unfused_vs_single_rank": rel_l2(unfused, reference),
                "fused_vs_single_rank": rel_l2(fused, reference),
                "ws_layout_vs_float64": rel_l2(ws, _ws_expected(args, world, rank)),
                "bitwise_run_to_run": torch.equal(fused, again),
                "shape_ok": tuple(fused.shape) == tuple(x_rank.shape),
                # TP: every rank holds the whole output; SP: each rank its own tokens.
                "tp_same_on_all_ranks": sp or all(torch.equal(g, fused) for g in gathered),
            }
    return report


# mxfp4 changes only the routed experts, which every rank computes alike: one world size is enough.
RANK_CASES = {2: [(BF16, "bf16"), (FP32, "bf16"), (BF16, "mxfp4")], 4: [(BF16, "bf16"), (FP32, "bf16")]}


@pytest.mark.parametrize("world", [2, 4])
def test_identity_on_gloo_ranks(world):
    seed, per_rank = multirank.results(world, "tests.test_identity:identity_on_ranks")
    for rank, report in enumerate(per_rank):
        assert len(report) == 2 * len(RANK_CASES[world])
        for (dtype, weight_format, mode), r in report.items():
            tol = TOL[BF16] if dtype == str(BF16) else TOL[FP32]
            where = f"R={world} rank {rank} seed {seed} {dtype} {weight_format} {mode}: {r}"
            assert r["shape_ok"] and r["bitwise_run_to_run"] and r["tp_same_on_all_ranks"], where
            for key in ("fused_vs_unfused", "unfused_vs_single_rank", "fused_vs_single_rank", "ws_layout_vs_float64"):
                assert r[key] <= tol, f"{key} {where}"
