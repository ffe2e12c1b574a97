"""The SP token gather by symmetric memory (symm_exchange.SymmetricExchange.gather_tokens) on the CPU.

R gloo processes share a stand-in for the symmetric workspace (tests/exchange_helpers.py: shared-memory buffers every
process maps, the copies' barrier a gloo barrier; the kernel method runs in Triton's interpreter). Checked:

- both methods gather every rank's [M, H] into [R*M, H] bitwise as all_gather_into_tensor does, bf16 and float32,
  call after call over the same workspace (fewer tokens after more: nothing stale survives), beside the other two
  kinds (a TP output gather between token gathers stays right: the regions and flags are apart);
- lmf::route_gather_and_produce's gather step (start_token_gather, symmetric=True), also as its CUDA backend calls
  it (the schedules stood in for), takes the peer writes where the exchange serves and fills the op's x_s bitwise;
- more tokens than max_tokens take the collective, with the reason, and the next call within the bound is symmetric
  again;
- the choice is the same on every rank: "auto" with the unmeasured window keeps the collective everywhere, a window
  decides by M alone;
- bad inputs raise errors that say what to do. The same on GPUs, inside the op: tests/test_route_gather_and_produce_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.common import symm_exchange
from latent_moe_fusion.ops.common.peer_exchange import FLAG_SETS, MAX_PROGRAMS
from latent_moe_fusion.ops.common.symm_exchange import TOKEN_WINDOWS, token_gather_exchange
from tests.exchange_helpers import BufferHandle, cpu_exchange, shared_cpu_buffers, token_bytes, workspace_sizes
from tests.gloo import run_gloo

HIDDEN = 64
MAX_TOKENS = 8


def _counting(calls: list[str]):
    import torch.distributed as dist

    real = dist.all_gather_into_tensor

    def counted(*args, **kwargs):
        calls.append("all_gather_into_tensor")
        return real(*args, **kwargs)

    return real, counted


def _collective(x: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    out = x.new_empty(world * x.shape[0], x.shape[1])
    dist.all_gather_into_tensor(out, x, group=dist.group.WORLD)
    return out


def _worker(rank: int, world: int, buffers: list[torch.Tensor], seed: int) -> dict:
    import torch.distributed as dist

    from latent_moe_fusion.ops.common import fragment_layouts as layouts
    from latent_moe_fusion.ops.routed.router_fused import route_gather_and_produce as rgp
    from latent_moe_fusion.ops.routed.router_fused.route_gather_and_produce import start_token_gather

    name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed + rank)  # each rank its own tokens: the gather must place them
    failures: list[str] = []
    rows: list[dict] = []
    calls: list[str] = []
    real, counted = _counting(calls)
    try:
        for method in ("copies", "kernel"):
            exchange = cpu_exchange(rank, buffers, MAX_TOKENS, HIDDEN, dist.barrier, group_name=name, method=method)
            symm_exchange._EXCHANGES[name] = exchange  # what prepare_symmetric_exchange registers on a GPU group
            for dtype in (torch.bfloat16, torch.float32):
                for tokens in (MAX_TOKENS, 3, 1, MAX_TOKENS + 1, 5):  # over the bound, then back under it
                    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
                    want = _collective(x, world)
                    before, calls[:] = exchange.token_gathers, []
                    chosen, reason = token_gather_exchange(name, x)
                    dist.all_gather_into_tensor = counted
                    got = layouts.gather_tokens(x, name)
                    x_s = torch.full_like(want, float("nan"))
                    start_token_gather(x_s, x, name, symmetric=True)  # the op's CUDA gather step
                    dist.all_gather_into_tensor = real
                    rows.append({"method": method, "tokens": tokens, "dtype": str(dtype),
                                 "symmetric": exchange.token_gathers - before, "collectives": list(calls),
                                 "chosen": chosen is exchange, "reason": reason,
                                 "bitwise": bool(torch.equal(got, want) and torch.equal(x_s, want))})
                    # a TP output gather between token gathers: the kinds' regions and flags are apart
                    out_slice = torch.randn(tokens, HIDDEN // world, generator=gen).to(dtype)
                    if not torch.equal(layouts.gather_columns(out_slice, name),
                                       layouts.gather_columns(out_slice, name, symmetric=False)):
                        failures.append(f"{method} {dtype} output gather after token gather, M={tokens}")
            # The CUDA backend's own gather step, its schedules stood in for by one that runs the step and returns x_s.
            x = torch.randn(MAX_TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
            args = [None] * 24
            args[0], args[rgp.GROUP_SIZE], args[rgp.GROUP_NAME] = x, world, name
            real_schedules, before = rgp.route_and_produce_cuda, exchange.token_gathers
            rgp.route_and_produce_cuda = lambda *produce_args, gather: (gather(), produce_args[rgp.GROUP_SIZE])[1]
            try:
                x_s = rgp.route_gather_and_produce_cuda(*args)
            finally:
                rgp.route_and_produce_cuda = real_schedules
            rows.append({"method": method, "backend_step": exchange.token_gathers - before,
                         "backend_bitwise": bool(torch.equal(x_s, _collective(x, world)))})
            dist.barrier()  # peers clear this rank's busy flags after their last copy-out
            start = exchange.fragment_bytes + exchange.output_bytes
            if bool(buffers[rank][start:start + symm_exchange.flag_bytes(world)].view(torch.int32).any()):
                failures.append(f"{method}: flags not at rest")
            # rank-consistent choice: the unmeasured window under "auto", then a window chosen by M alone
            exchange.setting = "auto"
            auto = [token_gather_exchange(name, torch.zeros(m, HIDDEN, dtype=torch.bfloat16)) for m in (1, 8)]
            exchange.token_window = (4, 6)
            windowed = [token_gather_exchange(name, torch.zeros(m, HIDDEN, dtype=torch.bfloat16))[0] is not None
                        for m in (3, 4, 6, 7)]
            x = torch.randn(5, HIDDEN, generator=gen).to(torch.bfloat16)
            before = exchange.token_gathers
            windowed_bitwise = bool(torch.equal(layouts.gather_tokens(x, name), _collective(x, world)))
            choice = {"auto": [(e is None, r) for e, r in auto], "windowed": windowed,
                      "windowed_symmetric": exchange.token_gathers - before, "windowed_bitwise": windowed_bitwise}
            every: list = [None] * world
            dist.all_gather_object(every, choice)
            rows.append({"method": method, "choice": choice, "same_on_every_rank": all(c == choice for c in every)})
    finally:
        dist.all_gather_into_tensor = real
        symm_exchange.release_symmetric_exchange(name)
    return {"rows": rows, "failures": failures}


@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_token_gather_is_the_collective_bitwise(world, rng_seed):
    buffers = shared_cpu_buffers(world, MAX_TOKENS, HIDDEN)
    per_rank = run_gloo(_worker, world, (buffers, rng_seed), timeout=600, preload=("latent_moe_fusion",))
    for rank, res in enumerate(per_rank):
        assert res["failures"] == [], (rank, res["failures"])
        gathers = [row for row in res["rows"] if "tokens" in row]
        assert len(gathers) == 2 * 2 * 5, gathers
        for row in gathers:
            assert row["bitwise"], (rank, row)
            if row["tokens"] > MAX_TOKENS:  # the collective, with the reason
                # gather_tokens' collective counted (the op's step calls all_gather_single, bound at import)
                assert row["symmetric"] == 0 and row["collectives"] == ["all_gather_into_tensor"], (rank, row)
                assert not row["chosen"] and "max_tokens = 8" in row["reason"], (rank, row)
            else:  # both calls (gather_tokens and the op's step) by peer writes
                assert row["symmetric"] == 2 and row["collectives"] == [], (rank, row)
                assert row["chosen"] and row["reason"] == "", (rank, row)
        for row in (row for row in res["rows"] if "backend_step" in row):  # the CUDA backend gathers symmetrically
            assert row["backend_step"] == 1 and row["backend_bitwise"], (rank, row)
        for row in (row for row in res["rows"] if "choice" in row):
            assert row["same_on_every_rank"], (rank, row)
            choice = row["choice"]
            assert all(none and "not measured" in reason for none, reason in choice["auto"]), (rank, row)
            assert choice["windowed"] == [False, True, True, False], (rank, row)
            assert choice["windowed_symmetric"] == 1 and choice["windowed_bitwise"], (rank, row)


def _single_exchange(method: str = "copies", with_tokens: bool = True) -> symm_exchange.SymmetricExchange:
    """A two-rank stand-in that only this process uses: enough for the checks that refuse before any peer write."""
    buffers = [torch.zeros(workspace_sizes(2, MAX_TOKENS, HIDDEN)[2], dtype=torch.uint8) for _ in range(2)]
    exchange = cpu_exchange(0, buffers, MAX_TOKENS, HIDDEN, lambda: None, method=method)
    if not with_tokens:  # as a workspace laid out before the token region existed
        exchange = symm_exchange.SymmetricExchange(exchange.group_name, 2, 0, exchange.device, MAX_TOKENS, HIDDEN,
                                                   "on", buffers[0], exchange.handle, exchange.fragment_bytes,
                                                   exchange.output_bytes, method=method)
    return exchange


def test_unmeasured_window_keeps_the_collective_by_default():
    assert TOKEN_WINDOWS == {"kernel": None, "copies": None}  # "never" under auto until bench/tp.py measures it
    for method in ("kernel", "copies"):
        exchange = _single_exchange(method)
        exchange.setting = "auto"
        reason = exchange.token_gather_refusal(4, HIDDEN, torch.bfloat16, torch.device("cpu"))
        assert reason is not None and "not measured" in reason and "LMF_SYMM_EXCHANGE=on" in reason
        exchange.setting = "on"
        assert exchange.token_gather_refusal(4, HIDDEN, torch.bfloat16, torch.device("cpu")) is None


def test_token_region_follows_the_flags_without_overlap():
    exchange = _single_exchange()
    fragment_bytes, output_bytes, total = workspace_sizes(2, MAX_TOKENS, HIDDEN)
    assert exchange._region_offset("tokens") == fragment_bytes + output_bytes + symm_exchange.flag_bytes(2)
    assert exchange._region_offset("tokens") + token_bytes(2, MAX_TOKENS, HIDDEN) == total
    assert exchange._flags_offset("tokens") + FLAG_SETS * 2 * MAX_PROGRAMS * 4 == exchange._region_offset("tokens")
    # the copies' [R, max_tokens, H] slots fit, in the prepared itemsize
    assert token_bytes(2, MAX_TOKENS, HIDDEN, 2) >= 2 * MAX_TOKENS * HIDDEN * 2


def test_bad_inputs_say_what_to_do():
    exchange = _single_exchange()
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"2-D \[M, H\]"):
        exchange.gather_tokens(torch.zeros(HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"max_tokens = 8.*token_gather_exchange.*prepare"):
        exchange.gather_tokens(torch.zeros(MAX_TOKENS + 1, HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"hidden = 64"):
        exchange.gather_tokens(torch.zeros(2, 2 * HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be a contiguous \[R\*M, H\] = \[4, 64\]"):
        exchange.gather_tokens(torch.zeros(2, HIDDEN, dtype=torch.bfloat16), torch.empty(2, HIDDEN,
                                                                                         dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be .*float32"):
        exchange.gather_tokens(torch.zeros(2, HIDDEN), torch.empty(4, HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="not contiguous"):
        exchange.gather_tokens(torch.zeros(2, HIDDEN), torch.empty(HIDDEN, 4).t())
    assert "tokens are on meta" in exchange.token_gather_refusal(2, HIDDEN, torch.bfloat16, torch.device("meta"))
    bare = _single_exchange(with_tokens=False)
    assert bare.token_gather_refusal(2, HIDDEN, torch.bfloat16, cpu) == "the workspace has no token region"
    exchange, reason = token_gather_exchange("no such group", torch.zeros(2, HIDDEN))
    assert exchange is None and "prepare_symmetric_exchange" in reason
    assert token_gather_exchange(None, torch.zeros(2, HIDDEN))[0] is None


def test_kernel_method_refuses_a_grid_its_places_do_not_hold():
    exchange = _single_exchange("kernel")
    exchange.token_programs = 10_000  # more programs than the workspace has flags for
    reason = exchange.token_gather_refusal(MAX_TOKENS, HIDDEN, torch.bfloat16, torch.device("cpu"))
    assert reason is not None and "do not fit" in reason


def test_buffer_handle_is_the_stand_in():  # the helpers' workspace includes the token region
    buffers = shared_cpu_buffers(2, MAX_TOKENS, HIDDEN)
    assert buffers[0].numel() == workspace_sizes(2, MAX_TOKENS, HIDDEN)[2]
    assert isinstance(cpu_exchange(1, buffers, MAX_TOKENS, HIDDEN, lambda: None).handle, BufferHandle)
