"""lmf::route_gather_and_produce on the CPU: its outputs are bitwise those of lmf::route_and_produce on the
rank-major gather of every rank's tokens (one rank in process, 2 and 4 gloo ranks), opcheck, and bad arguments
(on a single-process fake group of 2 ranks)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from latent_moe_fusion import KimiK3MoEBlock
from latent_moe_fusion.ops.routed.router_fused.route_gather_and_produce import all_gather_single
from tests import multirank
from tests.bad_arguments import assert_refused
from tests.fusion_models import fake_group
from tests.op_inputs import TINY, randn
from tests.test_route_and_produce import _args as _route_and_produce_args

OP = torch.ops.lmf.route_gather_and_produce
NAMES = [a.name for a in OP.default._schema.arguments]
BF16, FP32 = torch.bfloat16, torch.float32


def _block(seed: int, dtype: torch.dtype, weight_format: str) -> KimiK3MoEBlock:
    return KimiK3MoEBlock(TINY, weight_format=weight_format, dtype=dtype, seed=seed, ep_size=2, ep_rank=1)


def _args(block: KimiK3MoEBlock, x: torch.Tensor, group_name: str, world: int, router_gemm: str = "fp32") -> dict:
    """The op's arguments in schema order (those of lmf::route_and_produce, group_size in x_s's place, no mode)."""
    args = _route_and_produce_args(block, x, router_gemm) | {"group_size": world, "group_name": group_name}
    return {name: args[name] for name in NAMES}


def _gathered_reference(args: dict, group_name: str, world: int) -> tuple[torch.Tensor, tuple]:
    """(x_s, lmf::route_and_produce's outputs on it): the op's definition with the gather done apart."""
    x = args["x"]
    x_s = x.new_empty(world * x.shape[0], x.shape[1])
    all_gather_single(x_s, x, group=dist.group.WORLD)
    full = _route_and_produce_args_from(args, x_s)
    return x_s, torch.ops.lmf.route_and_produce(**full)


def _route_and_produce_args_from(args: dict, x_s: torch.Tensor) -> dict:
    rest = {k: v for k, v in args.items() if k != "group_size"}
    return {**{k: rest[k] for k in NAMES[:19]}, "x_s": x_s, **{k: rest[k] for k in ("w1_s", "w3_s", "w2_s")},
            "mode": "token_publish", "group_name": rest["group_name"]}


@contextlib.contextmanager
def _one_rank_group() -> Iterator[str]:
    """A real one-rank gloo group in this process (the gather copies x)."""
    assert not dist.is_initialized(), "a process group is already initialized in this process"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype, weight_format", [(BF16, "mxfp4"), (BF16, "bf16"), (FP32, "bf16")])
def test_one_rank_outputs_are_route_and_produce_on_the_gathered_tokens_and_opcheck(rng_seed, dtype, weight_format):
    block = _block(rng_seed % 1000, dtype, weight_format)
    x = randn((5, TINY.hidden_size), torch.Generator().manual_seed(rng_seed), dtype=dtype)
    with _one_rank_group() as group_name:
        args = _args(block, x, group_name, 1)
        y_n, ws = OP(**args)
        x_s, (want_y_n, want_ws) = _gathered_reference(args, group_name, 1)
        assert torch.equal(x_s, x)
        assert torch.equal(y_n, want_y_n) and torch.equal(ws, want_ws)
        assert ws.shape == (5, 1, TINY.hidden_size) and y_n.dtype == ws.dtype == dtype
        result = torch.library.opcheck(OP, (), args)
    assert result and all(v == "SUCCESS" for v in result.values()), result


def gather_op_on_ranks(rank: int, world: int, seed: int) -> dict:
    """Every rank calls the op on its own tokens, then lmf::route_and_produce on a gather done apart, in the same order
    on every rank (the collectives pair up); then opcheck (every rank runs the same checks)."""
    group_name = dist.group.WORLD.group_name
    results = {}
    for dtype, weight_format, m in ((BF16, "mxfp4", 3), (FP32, "bf16", 6)):
        block = _block(seed % 1000, dtype, weight_format)
        tokens = [randn((m, TINY.hidden_size), torch.Generator().manual_seed(seed + r), dtype=dtype)
                  for r in range(world)]  # every rank's tokens, drawn on every rank to check the gather's order
        args = _args(block, tokens[rank], group_name, world)
        y_n, ws = OP(**args)
        x_s, (want_y_n, want_ws) = _gathered_reference(args, group_name, world)
        results[f"{dtype}/{weight_format}"] = {
            "rank_major": bool(torch.equal(x_s, torch.cat(tokens))),
            "bitwise": bool(torch.equal(y_n, want_y_n) and torch.equal(ws, want_ws)),
            "ws_shape": tuple(ws.shape),
        }
    # the dynamic-shape AOT trace (seconds on 2 cores) at R = 2 only: the fake impl's shapes do not depend on R
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    opcheck = torch.library.opcheck(OP, (), args, test_utils=checks + (("test_aot_dispatch_dynamic",) if world == 2
                                                                         else ()))
    results["opcheck"] = dict(opcheck)
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_outputs_are_bitwise_those_on_the_gathered_tokens(world):
    seed, per_rank = multirank.results(world, "tests.test_route_gather_and_produce:gather_op_on_ranks")
    for rank, results in enumerate(per_rank):
        opcheck = results.pop("opcheck")
        assert opcheck and all(v == "SUCCESS" for v in opcheck.values()), (rank, seed, opcheck)
        for case, res in results.items():
            assert res["rank_major"] and res["bitwise"], (rank, seed, case, res)
            assert res["ws_shape"][1:] == (world, TINY.hidden_size), (rank, case, res)


# -- bad arguments (single-process fake group of 2 ranks: every check runs before the gather) ---------------------

H, L = TINY.hidden_size, TINY.latent_size
BAD = [
    ("group_size", dict(group_size=4), r"group_size = 4 but group '.*' has 2 ranks: pass R"),
    ("group_size", dict(group_size=1), r"group_size = 1 but group '.*' has 2 ranks"),
    ("group_name", dict(group_name="no_such_group"), r"group_name='no_such_group' names no process group"),
    ("x", dict(x=torch.randn(4 * H).bfloat16()), r"x must be 2-D, got shape \(1024,\)"),
    ("x", dict(x=torch.randn(1, 4, H).bfloat16()), r"x must be 2-D, got shape \(1, 4, 256\)"),
    ("x", dict(x=torch.randn(4, H).half()), "x must have dtype bfloat16, float32; got float16"),
    ("x", dict(x=torch.randn(H, 4).bfloat16().t()), "x must be contiguous"),
    # the shared weights are checked against x_s, the gathered x: the message says what x_s is here
    ("w1_s", dict(w1_s=torch.randn(8, H + 8).bfloat16()),
     r"w1_s has shape \(8, 264\).*\(here x_s is every rank's x gathered: \[R\*M = 2 \* 4, H = 256\]\)"),
    ("w_down", dict(w_down=torch.randn(L, H - 8).bfloat16()), r"w_down has shape \(128, 248\): expected \[L, H = 256\]"),
    ("num_local", dict(num_local=TINY.num_experts // 2 - 1), "num_local = 7 but w13 holds 8 experts"),
]


def _good(group_name: str) -> dict:
    block = _block(1, BF16, "mxfp4")
    return _args(block, randn((4, H), torch.Generator().manual_seed(1), dtype=BF16), group_name, 2)


@pytest.mark.parametrize("name, change, message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_name_the_argument(name, change, message):
    with fake_group(2) as group:
        assert_refused(OP, "route_gather_and_produce", _good(group.group_name) | change, message)


def test_hidden_not_divisible_by_the_group_and_a_missing_group_are_refused():
    with fake_group(3) as group:
        assert_refused(OP, "route_gather_and_produce", _good(group.group_name) | {"group_size": 3},
                       "hidden size 256 is not divisible by R = 3")
        with pytest.raises(RuntimeError, match="Expected a value of type 'str' for argument 'group_name'"):
            OP(**(_good(group.group_name) | {"group_name": None}))
    assert_refused(OP, "route_gather_and_produce", _good("0"), "group_name='0' was given but torch.distributed is not "
                   "initialized")
