"""Each lmf op against the float64 math of tests/float64_reference.py (R = 1 layouts; R > 1 in test_identity)."""

import pytest
import torch

from tests.float64_reference import rel_l2, rms_norm64, routed64, shared64, tail64
from tests.op_inputs import TINY, distinct_ids, producer_args, routed_args, tail_args

BF16, FP32 = torch.bfloat16, torch.float32
TOL = {BF16: 1e-2, FP32: 1e-5}
# (activation dtype, weight_format): dense weights are in the activation dtype.
FORMATS = [(BF16, "bf16"), (FP32, "bf16"), (BF16, "mxfp4"), (FP32, "mxfp4")]
FORMAT_IDS = ["bf16", "fp32", "bf16-mxfp4", "fp32-mxfp4"]


def _ids(case: str, gen: torch.Generator) -> torch.Tensor:
    """Routing patterns: random (odd M), one token, every token on one expert, skipped ids, few tokens."""
    e, k = TINY.num_experts, TINY.top_k
    if case == "random_odd_m":
        return distinct_ids(33, e, k, gen)
    if case == "m1":
        return distinct_ids(1, e, k, gen)
    if case == "all_on_one_expert":
        ids = distinct_ids(12, e - 1, k, gen)
        ids = torch.where(ids >= 5, ids + 1, ids)  # never expert 5 ...
        ids[:, 1] = 5  # ... except in slot 1 of every token
        return ids
    if case == "skipped":
        ids = distinct_ids(9, e, k, gen)
        ids[ids % 3 == 0] = -1  # experts on "another rank"
        ids[4] = -1  # a token with no expert here at all
        ids[7, 2] = -7
        return ids
    if case == "few_tokens":
        return distinct_ids(2, e, k, gen)  # at most 8 of 16 experts get a token
    raise ValueError(case)


ID_CASES = ["random_odd_m", "m1", "all_on_one_expert", "skipped", "few_tokens"]


@pytest.mark.parametrize("case", ID_CASES)
@pytest.mark.parametrize("dtype, weight_format", FORMATS, ids=FORMAT_IDS)
def test_routed_experts(rng_seed, dtype, weight_format, case):
    gen = torch.Generator().manual_seed(rng_seed)
    ids = _ids(case, gen)
    args = routed_args(ids.shape[0], dtype, weight_format, gen, ids=ids)
    y = torch.ops.lmf.routed_experts(**args)
    assert y.dtype == dtype and y.shape == (ids.shape[0], TINY.latent_size)
    ref = routed64(**args)
    assert rel_l2(y, ref) <= TOL[dtype]
    nothing_here = (ids < 0).all(dim=1)
    assert torch.equal(y[nothing_here], torch.zeros_like(y[nothing_here]))
    assert y[~nothing_here].abs().amax(dim=1).gt(0).all()
    if case == "few_tokens":
        assert torch.unique(ids).numel() < TINY.num_experts


@pytest.mark.parametrize("mode", ["local", "hidden_scatter", "token_publish"])
@pytest.mark.parametrize("dtype, weight_format", FORMATS, ids=FORMAT_IDS)
def test_moe_shared_producer_single_rank(rng_seed, dtype, weight_format, mode):
    gen = torch.Generator().manual_seed(rng_seed)
    args = producer_args(7, dtype, weight_format, gen, mode=mode)
    y_n, ws = torch.ops.lmf.moe_shared_producer(**args)
    assert y_n.dtype == ws.dtype == dtype
    assert y_n.shape == (7, TINY.latent_size)
    assert ws.shape == ((7, 1, TINY.hidden_size) if mode == "token_publish" else (1, 7, TINY.hidden_size))
    routed_names = ("z", "topk_ids", "topk_weights", "w13", "w2", "w13_scale", "w2_scale", "weight_format", "beta", "lin_beta")
    y_ref = rms_norm64(routed64(*(args[n] for n in routed_names)), args["rms_weight"], args["eps"])
    s_ref = shared64(args["x_s"], args["w1_s"], args["w3_s"], args["w2_s"], args["beta"], args["lin_beta"])
    assert rel_l2(y_n, y_ref) <= TOL[dtype]
    assert rel_l2(ws.reshape(7, -1), s_ref) <= TOL[dtype]


def test_moe_shared_producer_fp32_rms_weight_with_bf16_activations(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    args = producer_args(5, BF16, "bf16", gen)
    args["rms_weight"] = args["rms_weight"].float() + 1e-3 * torch.randn(TINY.latent_size, generator=gen)
    y_n, _ = torch.ops.lmf.moe_shared_producer(**args)
    routed_names = ("z", "topk_ids", "topk_weights", "w13", "w2", "w13_scale", "w2_scale", "weight_format", "beta", "lin_beta")
    y_ref = rms_norm64(routed64(*(args[n] for n in routed_names)), args["rms_weight"], args["eps"])
    assert y_n.dtype == BF16 and rel_l2(y_n, y_ref) <= TOL[BF16]


@pytest.mark.parametrize("m", [1, 6, 17])
@pytest.mark.parametrize("mode", ["local", "hidden_scatter", "token_publish"])
@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_latent_tail_single_rank(rng_seed, dtype, mode, m):
    gen = torch.Generator().manual_seed(rng_seed)
    args = tail_args(m, dtype, gen, mode=mode)
    out = torch.ops.lmf.latent_tail(**args)
    assert out.dtype == dtype and out.shape == (m, TINY.hidden_size)
    fragment = args["ws"][:, 0] if mode == "token_publish" else args["ws"][0]
    assert rel_l2(out, tail64(args["y_n"], args["w_up"], [fragment])) <= TOL[dtype]


def test_latent_tail_rounds_once(rng_seed):
    """The fp32 sum of matmul and fragment is rounded once: bf16 output equals the rounded fp64 sum
    almost everywhere (a double rounding would be off by one bf16 ulp far more often)."""
    gen = torch.Generator().manual_seed(rng_seed)
    args = tail_args(64, BF16, gen)
    out = torch.ops.lmf.latent_tail(**args)
    ref = tail64(args["y_n"], args["w_up"], [args["ws"][0]]).to(BF16)
    assert (out != ref).float().mean().item() < 0.01


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_empty_batch(rng_seed, weight_format):
    gen = torch.Generator().manual_seed(rng_seed)
    y_n, ws = torch.ops.lmf.moe_shared_producer(**producer_args(0, BF16, weight_format, gen))
    assert y_n.shape == (0, TINY.latent_size) and ws.shape == (1, 0, TINY.hidden_size)
    assert torch.ops.lmf.latent_tail(**tail_args(0, BF16, gen)).shape == (0, TINY.hidden_size)
