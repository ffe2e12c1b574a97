"""lmf::route_and_produce on the CPU: its outputs are those of lmf::route_and_project then
lmf::moe_shared_producer (bitwise), the block through it against float64, opcheck, bad arguments and the
shared-first switch."""

import pytest
import torch

from latent_moe_fusion import KimiK3MoEBlock
from latent_moe_fusion.ops.routed.router_fused.route_and_produce import (
    ROUTER_FIRST_MAX_TOKENS,
    SHARED_FIRST_MAX_TOKENS,
    SHARED_FIRST_MIN_TOKENS,
    URGENT_MAX_TOKENS,
    shared_first_order,
    shared_first_urgent,
    shared_first_wanted,
)
from latent_moe_fusion.reference64 import block_float64
from tests.bad_arguments import assert_refused
from tests.op_inputs import TINY, randn, shared_gate_up

OP = torch.ops.lmf.route_and_produce


def _args(block: KimiK3MoEBlock, x: torch.Tensor, router_gemm: str = "fp32") -> dict:
    cfg = block.cfg
    w1_s, w3_s = shared_gate_up(block)
    return dict(x=x, gate_weight=block.gate_weight, correction_bias=block.correction_bias, w_down=block.w_down,
                router_gemm=router_gemm, top_k=cfg.top_k, renorm_eps=1e-20, scaling_factor=cfg.routed_scaling_factor,
                first_expert=block.first_expert, num_local=block.num_local_experts, w13=block.w13, w2=block.w2,
                w13_scale=block.w13_scale, w2_scale=block.w2_scale, weight_format=block.weight_format,
                beta=cfg.situ_beta, lin_beta=cfg.situ_linear_beta, rms_weight=block.norm_weight, eps=cfg.rms_norm_eps,
                x_s=x, w1_s=w1_s, w3_s=w3_s, w2_s=block.shared_w2, mode="local", group_name=None)


def _block(seed: int, dtype: torch.dtype, weight_format: str, ep_size: int = 1) -> KimiK3MoEBlock:
    return KimiK3MoEBlock(TINY, weight_format=weight_format, dtype=dtype, seed=seed, ep_size=ep_size,
                          ep_rank=ep_size - 1)


@pytest.mark.parametrize("dtype, weight_format", [(torch.bfloat16, "mxfp4"), (torch.bfloat16, "bf16"),
                                                  (torch.float32, "bf16")])
@pytest.mark.parametrize("m, ep_size", [(1, 1), (7, 2)])
def test_outputs_are_those_of_the_two_ops(rng_seed, dtype, weight_format, m, ep_size):
    block = _block(rng_seed % 1000, dtype, weight_format, ep_size)
    x = randn((m, TINY.hidden_size), torch.Generator().manual_seed(rng_seed), dtype=dtype)
    args = _args(block, x)
    y_n, ws = OP(**args)
    values = list(args.values())
    ids, weights, z = torch.ops.lmf.route_and_project(*values[:10])
    want_y_n, want_ws = torch.ops.lmf.moe_shared_producer(z, ids, weights, *values[10:])
    assert torch.equal(y_n, want_y_n) and torch.equal(ws, want_ws)
    assert y_n.dtype == ws.dtype == dtype and ws.shape == (1, m, TINY.hidden_size)
    # the whole block through it, against float64 (the routing of the FP32 router GEMM on both sides)
    out = torch.ops.lmf.latent_tail(y_n, block.w_up, ws, "local", None)
    out64 = block_float64(block, x)
    rel = float((out.double() - out64).norm() / out64.norm())
    assert rel < (1e-5 if dtype == torch.float32 else 1.5e-2), rel


@pytest.mark.parametrize("dtype, weight_format", [(torch.bfloat16, "mxfp4"), (torch.float32, "bf16")])
def test_opcheck(rng_seed, dtype, weight_format):
    block = _block(rng_seed % 1000, dtype, weight_format, ep_size=2)
    x = randn((3, TINY.hidden_size), torch.Generator().manual_seed(rng_seed), dtype=dtype)
    result = torch.library.opcheck(OP, tuple(_args(block, x).values()))
    assert result and all(v == "SUCCESS" for v in result.values()), result


def _good() -> dict:
    block = _block(1, torch.bfloat16, "mxfp4", ep_size=2)
    return _args(block, randn((4, TINY.hidden_size), torch.Generator().manual_seed(1), dtype=torch.bfloat16), "bf16")


H, L = TINY.hidden_size, TINY.latent_size
BAD = [
    ("x", dict(x=torch.randn(4, H)), "router_gemm 'bf16' multiplies BF16 operands"),
    ("w_down", dict(w_down=torch.randn(L, H - 8).bfloat16()), r"w_down has shape \(128, 248\): expected \[L, H = 256\]"),
    ("num_local", dict(num_local=TINY.num_experts // 2 - 1), "num_local = 7 but w13 holds 8 experts"),
    ("rms_weight", dict(rms_weight=torch.ones(L + 1).bfloat16()), r"rms_weight has shape \(129,\), expected \(128,\)"),
    ("x_s", dict(x_s=torch.randn(5, H).bfloat16()), "x_s"),
    ("w1_s", dict(w1_s=torch.randn(8, H + 8).bfloat16()), "w1_s"),
    ("mode", dict(mode="scatter"), "mode must be one of"),
    # mxfp4 needs L in multiples of 32: the producer's check names z, which this op makes from x and w_down
    ("w_down", dict(w_down=torch.randn(48, H).bfloat16()),
     r"z.shape\[1\] = 48 .* \(here z = x @ w_down\^T is \[M = 4: x's rows, L = 48: w_down's rows\]\)"),
    ("weight_format", dict(weight_format="fp8"), "weight_format"),
]


@pytest.mark.parametrize("name, change, message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_name_the_argument(name, change, message):
    assert_refused(OP, "route_and_produce", _good() | change, message)


def test_shared_first_switch(tuned):
    assert not shared_first_wanted(SHARED_FIRST_MIN_TOKENS - 1) and shared_first_wanted(SHARED_FIRST_MIN_TOKENS)
    assert shared_first_wanted(SHARED_FIRST_MAX_TOKENS) and not shared_first_wanted(SHARED_FIRST_MAX_TOKENS + 1)
    tuned(shared_first_schedule=False)
    assert not shared_first_wanted(8)
    tuned(shared_first_schedule=True)
    assert shared_first_wanted(1) and shared_first_wanted(4096)
    with pytest.raises(ValueError, match="shared_first_schedule='on': expected True / 1"):
        tuned(shared_first_schedule="on")


def test_launch_order_switch(tuned):
    assert shared_first_order(ROUTER_FIRST_MAX_TOKENS) == ("router", "shared", "down")
    assert shared_first_order(ROUTER_FIRST_MAX_TOKENS + 1) == ("shared", "router", "down")
    tuned(shared_first_order="down, router,shared")
    assert shared_first_order(8) == shared_first_order(128) == ("down", "router", "shared")
    for bad in ("router,down", "router,down,down", "gate,router,down"):
        with pytest.raises(ValueError, match=r"shared_first_order=.*expected the three branches \(in launch order\) shared, router, down"):
            tuned(shared_first_order=bad)


def test_urgent_branches_switch(tuned):
    assert shared_first_urgent(URGENT_MAX_TOKENS) == "all" and shared_first_urgent(URGENT_MAX_TOKENS + 1) == "none"
    for value in ("none", "route", "all"):
        tuned(shared_first_urgent=value)
        assert shared_first_urgent(1) == shared_first_urgent(128) == value
    with pytest.raises(ValueError, match="shared_first_urgent='1': expected one of none, route, all"):
        tuned(shared_first_urgent="1")
