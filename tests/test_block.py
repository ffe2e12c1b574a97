"""KimiK3MoEBlock options agree on the same seed; expert parallelism splits the routed output; bad arguments."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from latent_moe_fusion import ConfigError, KimiK3MoEBlock
from latent_moe_fusion.model.router import route
from latent_moe_fusion.ops.common.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.float64_reference import rel_l2
from tests.op_inputs import TINY

BF16, FP32 = torch.bfloat16, torch.float32
TOL = {BF16: 1e-2, FP32: 1e-5}


def _x(tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(tokens, TINY.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


class RecordRoutedCalls(TorchDispatchMode):
    """Records the arguments of every lmf::routed_experts call made under it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.lmf.routed_experts.default:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def test_weights_are_the_same_function_of_the_seed(rng_seed):
    full = KimiK3MoEBlock(TINY, dtype=FP32, seed=rng_seed)
    params = dict(full.named_parameters())
    bf16 = KimiK3MoEBlock(TINY, dtype=BF16, seed=rng_seed, shared_gate_up="split")
    for name, p in bf16.named_parameters():
        if name in ("shared_w1", "shared_w3"):
            half = TINY.shared_intermediate_size
            ref = params["shared_w13"][:half] if name == "shared_w1" else params["shared_w13"][half:]
        else:
            ref = params[name]
        expected = ref if name == "correction_bias" else ref.to(BF16)  # the bias stays fp32
        assert torch.equal(p, expected), name
    mxfp4 = KimiK3MoEBlock(TINY, dtype=BF16, weight_format="mxfp4", seed=rng_seed)
    for name in ("w13", "w2"):
        packed, scales = quantize_mxfp4(params[name])
        assert torch.equal(getattr(mxfp4, name), packed) and torch.equal(getattr(mxfp4, f"{name}_scale"), scales)
        assert rel_l2(dequantize_mxfp4(packed, scales), params[name]) < 0.2  # e2m1: ~2 significant bits
    assert not torch.equal(KimiK3MoEBlock(TINY, dtype=FP32, seed=rng_seed + 1).w_up, full.w_up)


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_shared_gate_up_and_rms_norm_forms_agree(rng_seed, dtype):
    x = _x(9, dtype, rng_seed)
    outs = {
        (gate_up, norm): KimiK3MoEBlock(TINY, dtype=dtype, seed=rng_seed, shared_gate_up=gate_up, rms_norm=norm)(x)
        for gate_up in ("merged", "split")
        for norm in ("functional", "manual")
    }
    base = outs[("merged", "functional")]
    assert base.dtype == dtype and base.shape == x.shape and base.isfinite().all()
    for key, out in outs.items():
        assert rel_l2(out, base) <= TOL[dtype], key


def test_fp32_block_agrees_with_bf16_block_on_the_same_weights(rng_seed):
    bf16 = KimiK3MoEBlock(TINY, dtype=BF16, seed=rng_seed)
    fp32 = KimiK3MoEBlock(TINY, dtype=FP32, seed=rng_seed)
    # Same values (the bf16 ones) in both: then routing is identical and only activation rounding differs.
    fp32.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    x = _x(9, BF16, rng_seed)
    assert rel_l2(bf16(x), fp32(x.float())) <= TOL[BF16]


def test_mxfp4_block_is_the_bf16_block_with_dequantized_weights(rng_seed):
    mxfp4 = KimiK3MoEBlock(TINY, dtype=BF16, weight_format="mxfp4", seed=rng_seed)
    dense = KimiK3MoEBlock(TINY, dtype=BF16, seed=rng_seed)
    with torch.no_grad():  # e2m1 * 2**k is exact in bf16, so this is the same function
        dense.w13.copy_(dequantize_mxfp4(mxfp4.w13, mxfp4.w13_scale, BF16))
        dense.w2.copy_(dequantize_mxfp4(mxfp4.w2, mxfp4.w2_scale, BF16))
    x = _x(9, BF16, rng_seed)
    assert torch.equal(mxfp4(x), dense(x))


@pytest.mark.parametrize("dtype", [BF16, FP32])
def test_expert_parallel_shares_sum_to_the_full_routed_output(rng_seed, dtype):
    ep = 4
    per_rank = TINY.num_experts // ep
    full = KimiK3MoEBlock(TINY, dtype=dtype, seed=rng_seed)
    x = _x(11, dtype, rng_seed)
    global_ids, _ = route(x, full.gate_weight, full.correction_bias, TINY.top_k, TINY.routed_scaling_factor)
    total = torch.zeros(x.shape[0], TINY.latent_size, dtype=torch.float64)
    for rank in range(ep):
        share = KimiK3MoEBlock(TINY, dtype=dtype, seed=rng_seed, ep_size=ep, ep_rank=rank)
        first = rank * per_rank
        assert torch.equal(share.w13, full.w13[first : first + per_rank])
        assert torch.equal(share.w2, full.w2[first : first + per_rank])
        with RecordRoutedCalls() as record:
            y = share.routed(x)
        ((_, ids, *_),) = record.calls
        mine = (global_ids >= first) & (global_ids < first + per_rank)
        assert torch.equal(ids, torch.where(mine, global_ids - first, -1).to(torch.int32))
        assert (ids == -1).any()
        total += y.double()
    assert rel_l2(total, full.routed(x)) <= TOL[dtype]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"dtype": torch.float16}, ValueError, "dtype must be torch.bfloat16 or torch.float32"),
        ({"shared_gate_up": "fused"}, ValueError, "shared_gate_up must be one of .* got 'fused'"),
        ({"rms_norm": "fast"}, ValueError, "rms_norm must be one of .* got 'fast'"),
        ({"sequence_parallel": True}, ValueError, "sequence_parallel=True needs a tp_group"),
        ({"weight_format": "fp8"}, ConfigError, "weight_format must be 'bf16' or 'mxfp4'"),
        ({"ep_size": 3}, ConfigError, "expert-parallel size 3"),
        ({"ep_size": 4, "ep_rank": 4}, ValueError, r"ep_rank must be in \[0, 4\), got 4"),
        ({"ep_size": 2, "ep_rank": -1}, ValueError, r"ep_rank must be in \[0, 2\), got -1"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        KimiK3MoEBlock(TINY, **kwargs)


def test_mxfp4_block_needs_blocks_of_32():
    cfg = TINY.replace(latent_size=48)
    KimiK3MoEBlock(cfg, weight_format="bf16")
    with pytest.raises(ConfigError, match="latent_size = 48 is not divisible by 32"):
        KimiK3MoEBlock(cfg, weight_format="mxfp4")


# -- a 2-rank group (tests/multirank.py runs this part on two gloo ranks) ---------------------------------------------


def expert_shares_on_ranks(rank: int, world: int, seed: int) -> dict:
    """TP blocks with EP shares: different shares per TP rank raise (the TP form replicates the routed branch), the
    same share on every rank and SP blocks with any shares build."""
    import torch.distributed as dist

    group = dist.group.WORLD
    outcome = {}
    for name, kwargs in {"tp_different_shares": {"ep_rank": rank}, "tp_same_share": {"ep_rank": 0},
                         "sp_different_shares": {"ep_rank": rank, "sequence_parallel": True}}.items():
        try:
            KimiK3MoEBlock(TINY, tp_group=group, seed=seed, ep_size=world, **kwargs)
            outcome[name] = ("built", "")
        except Exception as exc:  # the parent checks type and message
            outcome[name] = (type(exc).__name__, str(exc))
    return outcome


def test_tp_block_needs_the_same_expert_share_on_every_rank():
    from tests import multirank

    seed, per_rank = multirank.results(2, "tests.test_block:expert_shares_on_ranks")
    for rank, outcome in enumerate(per_rank):
        kind, message = outcome["tp_different_shares"]
        assert kind == "ValueError", (rank, seed, kind, message)
        assert "expert-parallel shares [0, 1]" in message and "same ep_rank" in message, (rank, message)
        assert outcome["tp_same_share"] == ("built", ""), (rank, outcome["tp_same_share"])
        assert outcome["sp_different_shares"] == ("built", ""), (rank, outcome["sp_different_shares"])
