"""The kappa kernels' wiring on CPU: the routed plan picks them for the 128-row prefill blocks by default and says so,
the staged_kernel override picks the others, and the launches hand each kernel parameter its value (the Gluon kernels
stand in as recorders here; the gather runs in the interpreter). The kernels themselves: tests/test_routed_staged_gpu.py
and tests/test_kappa_compile_sm90.py."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.common.mxfp4 import quantize_mxfp4
from latent_moe_fusion.ops.routed import kappa_path
from latent_moe_fusion.ops.routed.gluon import STAGED_BLOCK_ROWS, routed_kappa
from latent_moe_fusion.ops.routed.routed_plan import plan_routed
from latent_moe_fusion.ops.routed.triton.kappa_columns import to_kappa_columns


def _decision(plan, name: str):
    return next((d for d in plan.decisions if d.name == name), None)


def test_the_plan_runs_the_kappa_kernels_on_the_128_row_blocks(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the plan of a GPU process
    monkeypatch.delenv("LMF_ROUTED_W4A8", raising=False)
    prefill = plan_routed(16384, 16, 112, 3584, 3072)
    assert prefill.family == "staged" and prefill.staged_kernel == "kappa"
    assert _decision(prefill, "staged_kernel").value == "kappa"
    for other in ("kappa_plain", "staged", "ws"):
        assert plan_routed(16384, 16, 112, 3584, 3072, overrides={"staged_kernel": other}).staged_kernel == other
    decode = plan_routed(8, 16, 112, 3584, 3072)
    assert decode.staged_kernel is None and _decision(decode, "staged_kernel") is None
    monkeypatch.setenv("LMF_ROUTED_W4A8", "1")  # the W4A8 path runs its own kernels on those blocks
    assert plan_routed(16384, 16, 112, 3584, 3072).staged_kernel is None


class Recorder:
    """A Gluon kernel stand-in: kernel[grid](*args, **kwargs) records the call by parameter name."""

    def __init__(self, kernel) -> None:
        self.names = [p.name for p in kernel.params]
        self.calls: list[tuple[tuple[int, ...], dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            assert len(args) <= len(self.names), f"{len(args)} positional arguments for {len(self.names)} parameters"
            bound = dict(zip(self.names, args, strict=False)) | kwargs
            self.calls.append((grid, bound))
        return launch


def test_the_launches_give_every_kernel_parameter_its_value(monkeypatch, rng_seed):
    experts, latent, inter, top_k, blocks = 3, 256, 128, 2, 2
    w13, s13 = quantize_mxfp4(torch.randn(experts, 2 * inter, latent))
    w2, s2 = quantize_mxfp4(torch.randn(experts, latent, inter))
    z = torch.randn(5, latent, dtype=torch.bfloat16)
    sorted_pairs = torch.full((blocks * STAGED_BLOCK_ROWS,), -1, dtype=torch.int32)
    sorted_pairs[:7] = torch.tensor([0, 3, 4, 6, 7, 8, 9], dtype=torch.int32)
    block_expert = torch.tensor([2, -1], dtype=torch.int32)
    act = torch.empty(blocks * STAGED_BLOCK_ROWS, inter, dtype=torch.bfloat16)
    pairs = torch.empty(10, latent)
    l1, l2 = Recorder(routed_kappa.l1_kappa_kernel), Recorder(routed_kappa.l2_kappa_kernel)
    monkeypatch.setattr(routed_kappa, "l1_kappa_kernel", l1)
    monkeypatch.setattr(routed_kappa, "l2_kappa_kernel", l2)
    kappa_path.launch_l1_kappa(z, w13, s13, sorted_pairs, block_expert, act, blocks, top_k, 4.0, 25.0)
    kappa_path.launch_l2_kappa(act, w2, s2, sorted_pairs, block_expert, pairs, blocks)
    (grid1, a1), (grid2, a2) = l1.calls[0], l2.calls[0]
    launch_options = {"maxnreg"}
    assert set(a1) - launch_options == set(l1.names) and set(a2) - launch_options == set(l2.names)  # all given
    assert grid1 == (blocks * inter // 64,) and grid2 == (blocks * latent // 128,)
    assert a1["inter"] == inter and a1["K"] == latent and a1["row_words"] == latent // 8
    assert a1["row_scales"] == latent // 32 and a1["stride_we"] == 2 * inter * latent // 8
    assert a1["beta"] == 4.0 and a1["lin_beta"] == 25.0 and a1["act_ptr"] is act
    assert a2["latent"] == latent and a2["K"] == inter and a2["row_words"] == inter // 8 and a2["pairs_ptr"] is pairs
    # L1's activation rows: the block's tokens in kappa order (the gather ran in the interpreter)
    rows = a1["a_desc"].base
    tokens = (sorted_pairs[:STAGED_BLOCK_ROWS].clamp(min=0) // top_k).long()
    assert torch.equal(rows[:STAGED_BLOCK_ROWS], to_kappa_columns(z[tokens]))
    assert a1["a_desc"].block_shape == [STAGED_BLOCK_ROWS, 128] == a2["a_desc"].block_shape
    assert a2["a_desc"].base.data_ptr() == act.data_ptr() and a2["a_desc"].base.shape == act.shape  # L1's act as is
    assert a1["TIERS"] is True and a2["TIERS"] is True  # the default: the MMA's N by valid rows in tiers
    kappa_path.launch_l1_kappa(z, w13, s13, sorted_pairs, block_expert, act, blocks, top_k, 4.0, 25.0, "kappa_plain")
    kappa_path.launch_l2_kappa(act, w2, s2, sorted_pairs, block_expert, pairs, blocks, "kappa_plain")
    assert l1.calls[1][1]["TIERS"] is False and l2.calls[1][1]["TIERS"] is False
    with pytest.raises(ValueError, match="the kappa launchers run staged_kernel 'kappa' or 'kappa_plain', got 'ws'"):
        kappa_path.launch_l2_kappa(act, w2, s2, sorted_pairs, block_expert, pairs, blocks, "ws")


def test_the_launches_refuse_buffers_too_small_for_their_blocks(rng_seed):
    w2, s2 = quantize_mxfp4(torch.randn(2, 256, 128))
    pairs = torch.empty(8, 256)
    sorted_pairs = torch.zeros(2 * STAGED_BLOCK_ROWS, dtype=torch.int32)
    block_expert = torch.zeros(2, dtype=torch.int32)
    short = torch.empty(STAGED_BLOCK_ROWS, 128, dtype=torch.bfloat16)  # one block's rows for two blocks
    with pytest.raises(ValueError, match=r"kappa L2: act must be a contiguous \[>= 256, 128\] buffer"):
        kappa_path.launch_l2_kappa(short, w2, s2, sorted_pairs, block_expert, pairs, 2)
    act = torch.empty(2 * STAGED_BLOCK_ROWS, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="need 256 sorted pairs and 2 block experts, got 256 and 1"):
        kappa_path.launch_l2_kappa(act, w2, s2, sorted_pairs, block_expert[:1], pairs, 2)


def test_the_staged_launchers_refuse_the_kappa_kernels(rng_seed):
    """launch_routed_l1 / _l2 run the staged kernels or their warp-specialised form; asked (by the default override)
    for the kappa kernels, whose L1 and L2 must run as a pair, they say where those launch instead of running others."""
    from latent_moe_fusion.ops.routed.gluon import launch_routed_l1, launch_routed_l2

    w13, s13 = quantize_mxfp4(torch.randn(1, 256, 256))
    w2, s2 = quantize_mxfp4(torch.randn(1, 256, 128))
    ids = torch.zeros(STAGED_BLOCK_ROWS, dtype=torch.int32)
    experts = torch.zeros(1, dtype=torch.int32)
    act = torch.empty(STAGED_BLOCK_ROWS, 128, dtype=torch.bfloat16)
    z = torch.randn(3, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="the kappa kernels launch as a pair from kappa_path"):
        launch_routed_l1(z, w13, s13, ids, experts, act, 1, STAGED_BLOCK_ROWS, 16, 4.0, 25.0)
    with pytest.raises(ValueError, match="the kappa kernels launch as a pair from kappa_path"):
        launch_routed_l2(act, w2, s2, ids, experts, torch.empty(48, 256), 1, STAGED_BLOCK_ROWS, staged="kappa")
