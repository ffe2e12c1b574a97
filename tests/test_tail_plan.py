"""plan_tail agrees with what lmf::latent_tail runs: the backend select_backend picks (every backend's reason), and the
launch tail_fused makes (kernel, grid, split-K, fragment group, PDL), recorded on meta tensors with the Triton kernels
replaced by recorders; `plan-tail` prints the decisions and checks its arguments."""

from __future__ import annotations

import contextlib

import pytest
import torch

from latent_moe_fusion.__main__ import main, parse
from latent_moe_fusion.cli_args import CliError
from latent_moe_fusion.ops.common import pdl
from latent_moe_fusion.ops.common.backends import explain, select_backend
from latent_moe_fusion.ops.common.fragment_layouts import fragment_shape, rank_tail_operands
from latent_moe_fusion.ops.common.tail_gemm import tail_launch
from latent_moe_fusion.ops.common.tail_gemm.tail_gemm_configs import FEW_TOKENS_SWAP, fit_split_k, table_config
from latent_moe_fusion.ops.tail.cute import tail_backend as cute_tail
from latent_moe_fusion.ops.tail.cute.tail_runtime import key_for
from latent_moe_fusion.ops.tail.tail_plan import plan_tail
from latent_moe_fusion.ops.tail.triton import triton_tail_backend as triton_tail
from latent_moe_fusion.plan_tail_cli import check_arguments
from tests.fusion_models import fake_group

MS = (1, 2, 3, 8, 32, 128, 4096, 32768)
LAYOUTS = [("local", 1), ("hidden_scatter", 2), ("hidden_scatter", 8), ("token_publish", 8)]
H, L = 7168, 3584
SWITCHES = ("TRITON_INTERPRET", "LMF_BACKEND", "LMF_BACKEND_LATENT_TAIL")
TRITON_KERNELS = ("tail_gemv_kernel", "tail_swap_kernel", "tail_swap_tma_kernel", "tail_tile_kernel",
                  "tail_tile_tma_kernel")


@pytest.fixture
def hopper(monkeypatch):
    """This process as an sm_90 machine with the CuTe DSL installed, as the runtime's checks see it; switches unset."""
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)
    for module in (triton_tail, cute_tail):
        monkeypatch.setattr(module, "current_capability", lambda: (9, 0))
    monkeypatch.setattr(cute_tail, "installed", lambda: True)
    monkeypatch.setattr(pdl, "device_supports_pdl", lambda device: True)


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **meta)` records (name, grid, meta) and launches nothing."""

    def __init__(self, name: str, launches: list) -> None:
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((self.name, tuple(grid), meta))


def _operands(m: int, mode: str, world: int, dtype: torch.dtype = torch.bfloat16):
    meta = dict(dtype=dtype, device="meta")
    return (torch.empty(m, L, **meta), torch.empty(H, L, **meta),
            torch.empty(fragment_shape(mode, m, H, world), **meta))


def _runtime(m: int, mode: str, world: int, dtype: torch.dtype, monkeypatch):
    """(explain's reasons, the backend select_backend picks, rank operands, the Triton launch tail_fused makes)."""
    y_n, w_up, ws = _operands(m, mode, world, dtype)
    launches: list = []
    for name in TRITON_KERNELS:
        monkeypatch.setattr(tail_launch, name, _Recorder(name, launches))
    monkeypatch.setattr(tail_launch, "_COUNTERS", {})
    with fake_group(world) if world > 1 else contextlib.nullcontext() as group:
        group_name = None if group is None else group.group_name
        args = (y_n, w_up, ws, mode, group_name)
        reasons = explain("latent_tail", "cuda", *args)
        backend = select_backend("latent_tail", "cuda", *args).name
        operands = rank_tail_operands(*args)
    if backend == "triton":
        tail_launch.tail_fused(*operands)  # meta device: 132 SMs, as the plan's default
    return reasons, backend, operands, launches


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(("mode", "world"), LAYOUTS, ids=[f"{m}-{w}" for m, w in LAYOUTS])
@pytest.mark.parametrize("cute", [True, False], ids=["cute", "no-cute"])
def test_the_plan_follows_the_backend_choice_and_the_launch(hopper, monkeypatch, m, mode, world, cute):
    monkeypatch.setattr(cute_tail, "installed", lambda: cute)
    reasons, backend, (y, w, frags), launches = _runtime(m, mode, world, torch.bfloat16, monkeypatch)
    plan = plan_tail(m, H, L, torch.bfloat16, mode, world, cute_installed=cute)
    assert plan.backend == backend
    assert list(plan.backend_reasons) == reasons
    assert (plan.num_fragments, plan.num_tokens, plan.columns) == tuple(frags.shape)
    assert plan.fragments == fragment_shape(mode, m, H, world)
    assert all(d.reason for d in plan.decisions)
    if backend == "triton":
        (kernel, grid, meta), = launches
        assert plan.kernel == kernel and plan.grid == grid
        assert plan.config.block_n == meta["BLOCK_N"] and plan.config.num_warps == meta["num_warps"]
        assert plan.frag_group == meta["FRAG_GROUP"] and plan.pdl == meta.get("PDL", False)
        assert plan.config.split_k == meta.get("SPLIT_K", 1)
        if kernel == "tail_gemv_kernel":
            tiles = dict(plan_line.split("=") for plan_line in _value(plan, "tiles").replace(" rows", "").split(", "))
            assert [int(tiles[k]) for k in ("BLOCK_M", "BLOCK_K", "PRELOAD_K")] == [
                meta["BLOCK_M"], meta["BLOCK_K"], meta["PRELOAD_K"]]
        else:
            assert plan.config.block_m == meta["BLOCK_M"] and plan.config.block_k == meta["BLOCK_K"]
    elif backend == "cute":
        assert plan.config == key_for(m, y.dtype, frags.shape[0]).cfg
        assert not launches
    else:
        assert plan.config is None and plan.kernel.startswith("tail_math")


@pytest.mark.parametrize("m", (1, 8, 32, 4096))
def test_float32_takes_the_triton_tail_exact_dots(hopper, monkeypatch, m):
    reasons, backend, _, launches = _runtime(m, "local", 1, torch.float32, monkeypatch)
    plan = plan_tail(m, dtype=torch.float32)
    assert plan.backend == backend == "triton" and list(plan.backend_reasons) == reasons
    assert plan.config == table_config(m, True) and plan.grid == launches[0][1]
    assert "float32" in dict(plan.backend_reasons)["cute"]


def test_the_cute_dsl_given_or_not(hopper):
    on, off = plan_tail(8, cute_installed=True), plan_tail(8, cute_installed=False)
    assert on.backend == "cute" and off.backend == "triton"
    assert dict(off.backend_reasons)["cute"] == cute_tail.NOT_INSTALLED
    assert "CuTe DSL not installed (given)" in off.assumptions
    # Where the measured table keeps Triton, installing the DSL changes nothing.
    bound_triton = [m for m in MS if cute_tail.measured_choice().get(cute_tail.bucket_bound(m)) != "cute"]
    assert bound_triton and all(plan_tail(m, cute_installed=True).backend != "cute" for m in bound_triton)


def test_forcing_a_backend_is_followed_or_refused(hopper, monkeypatch):
    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "cute")
    forced = plan_tail(128, cute_installed=True)
    assert forced.backend == "cute" and "forced" in _reason(forced, "backend")
    with pytest.raises(RuntimeError, match="'cute' was forced .* not installed"):
        plan_tail(128, cute_installed=False)
    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "triton")
    assert plan_tail(8, cute_installed=True).backend == "triton"


@pytest.mark.parametrize(("capability", "why"), [((8, 0), "sm_80"), (None, "not cpu")])
def test_without_hopper_the_reference_runs(hopper, capability, why):
    plan = plan_tail(32, capability=capability, cute_installed=True)
    assert plan.backend == "reference" and plan.config is None
    assert why in dict(plan.backend_reasons)["triton"] and why in dict(plan.backend_reasons)["cute"]


def test_the_sm_count_and_the_gemv_override_reach_the_config(hopper):
    plan = plan_tail(8, mode="hidden_scatter", world_size=8, cute_installed=False, num_sms=132)
    few = plan_tail(8, mode="hidden_scatter", world_size=8, cute_installed=False, num_sms=16)
    for sms, p in ((132, plan), (16, few)):
        assert p.config == fit_split_k(table_config(8, False), H // 8, L, sms)
    assert plan.config.split_k > few.config.split_k  # 14 N tiles: more SMs, more K slices
    off = plan_tail(1, cute_installed=False, overrides={"tail_gemv": "off"})
    assert off.config.kernel == "swap" and off.config.block_n == FEW_TOKENS_SWAP.block_n
    assert "tail_gemv tuning override" in _reason(off, "config")
    assert plan_tail(1, cute_installed=False).kernel == "tail_gemv_kernel"


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="not divisible by the world size 3"):
        plan_tail(8, mode="token_publish", world_size=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        plan_tail(8, mode="scatter")
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        plan_tail(0)


def _value(plan, name: str) -> str:
    return next(d.value for d in plan.decisions if d.name == name)


def _reason(plan, name: str) -> str:
    return next(d.reason for d in plan.decisions if d.name == name)


def test_the_command_prints_the_decisions(hopper, capsys):
    assert main(["plan-tail", "--m", "32", "--cute", "no", "--mode", "token_publish", "--world-size", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    plan = plan_tail(32, mode="token_publish", world_size=4, cute_installed=False)
    assert lines == plan.lines()
    names = [line.split()[0] for line in lines]
    assert names[:3] == ["tokens", "fragments", "backend"] and lines[2].split()[1] == "triton"
    assert any(line.startswith("cute") and "not installed" in line for line in lines)
    assert main(["plan-tail", "--m", "32", "--cute", "yes"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[1] == plan_tail(32, cute_installed=True).backend


def test_a_forced_backend_that_cannot_run_is_one_line(hopper, monkeypatch, capsys):
    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "cute")
    assert main(["plan-tail", "--m", "8", "--cute", "no"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("plan-tail: lmf::latent_tail: backend 'cute' was forced") and "Traceback" not in err


def test_the_checks_raise_cli_errors():
    args = parse(["plan-tail", "--m", "8", "--mode", "token_publish", "--world-size", "8"])
    check_arguments(args)  # a good combination passes
    args.world_size = 3
    with pytest.raises(CliError, match="--hidden 7168 is not divisible by --world-size 3"):
        check_arguments(args)
