"""torch.library.opcheck for every op and layout: local in-process, hidden_scatter/token_publish on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist

from tests import multirank
from tests.op_inputs import producer_args, routed_args, tail_args

BF16, FP32 = torch.bfloat16, torch.float32
# (activation dtype, weight_format)
FORMATS = [(BF16, "bf16"), (FP32, "bf16"), (BF16, "mxfp4")]
FORMAT_IDS = ["bf16", "fp32", "bf16-mxfp4"]


# test_aot_dispatch_dynamic (a dynamic-shape AOT trace, seconds on 2 cores) checks the fake impl's symbolic
# shapes, which depend on the layout but not on the dtypes: the gloo workers run it for bf16 activations
# and weights (the local tests run it for every format) and the other checks for every format.
QUICK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _opcheck(op, kwargs: dict, quick: bool = False) -> dict:
    if quick:
        return torch.library.opcheck(op, (), kwargs, test_utils=QUICK_UTILS)
    return torch.library.opcheck(op, (), kwargs)


def _all_pass(result: dict) -> bool:
    return bool(result) and all(v == "SUCCESS" for v in result.values())


@pytest.mark.parametrize("dtype, weight_format", FORMATS, ids=FORMAT_IDS)
def test_opcheck_routed_experts(rng_seed, dtype, weight_format):
    gen = torch.Generator().manual_seed(rng_seed)
    result = _opcheck(torch.ops.lmf.routed_experts, routed_args(5, dtype, weight_format, gen))
    assert _all_pass(result), result


@pytest.mark.parametrize("dtype, weight_format", FORMATS, ids=FORMAT_IDS)
def test_opcheck_moe_shared_producer_local(rng_seed, dtype, weight_format):
    gen = torch.Generator().manual_seed(rng_seed)
    result = _opcheck(torch.ops.lmf.moe_shared_producer, producer_args(5, dtype, weight_format, gen))
    assert _all_pass(result), result


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_opcheck_latent_tail_local(rng_seed, dtype):
    gen = torch.Generator().manual_seed(rng_seed)
    result = _opcheck(torch.ops.lmf.latent_tail, tail_args(5, dtype, gen))
    assert _all_pass(result), result


def opcheck_layouts_on_ranks(rank: int, world: int, seed: int) -> dict:
    """Every rank runs the same opchecks in the same order (the ops' collectives must pair up)."""
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed + rank)
    results = {}
    for mode in ("hidden_scatter", "token_publish"):
        for dtype, weight_format in FORMATS:
            args = producer_args(3, dtype, weight_format, gen, mode=mode, group_name=group_name, world=world)
            results[f"producer/{mode}/{dtype}/{weight_format}"] = _opcheck(
                torch.ops.lmf.moe_shared_producer, args, quick=(dtype, weight_format) != (BF16, "bf16")
            )
        for dtype in (BF16, FP32):
            args = tail_args(3, dtype, gen, mode=mode, group_name=group_name, world=world)
            results[f"tail/{mode}/{dtype}"] = _opcheck(torch.ops.lmf.latent_tail, args, quick=dtype != BF16)
    return results


def test_opcheck_tp_and_sp_layouts_on_two_gloo_ranks():
    seed, per_rank = multirank.results(2, "tests.test_opcheck:opcheck_layouts_on_ranks")
    for rank, results in enumerate(per_rank):
        assert len(results) == 10
        full = [k for k, v in results.items() if "test_aot_dispatch_dynamic" in v]
        assert len(full) == 4, full
        failed = {k: v for k, v in results.items() if not _all_pass(v)}
        assert not failed, f"rank {rank} (seed {seed}): {failed}"
