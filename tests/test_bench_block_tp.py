"""bench/block_tp.py's parts that need no GPU: the row of R ranks (the slowest rank's medians, the floor with the
NVLink bytes), the SP floor's shared expert over the gathered tokens, the result files per R, and the launch under
torchrun or by spawning (R = 2, 4, 8). The timings themselves need R H200s."""

from __future__ import annotations

import json

import pytest
import torch

import latent_moe_fusion as lmf
from bench import block_tp
from bench.common import launch_on_gpus


def _rank_row(compiled_us: float, fused_us: float, err: float, local_floor_us: float, form: str = "TP",
              m: int = 4096) -> dict:
    row = {"form": form, "M": m, "tokens_per_rank": m, "hidden": 7168, "local_floor_us": local_floor_us,
           "timing": "back to back", "kernels": {}, "symm_publishes": 1,
           "compiled+fused_matched": "1 block, forms ['all_reduce']"}
    for name in block_tp.VARIANTS:
        row[f"{name}_us"] = fused_us if name != "compiled" else compiled_us
        row[f"{name}_err"] = err
    return row


@pytest.mark.parametrize("world", block_tp.WORLDS)
def test_a_row_is_the_slowest_rank_and_its_floor_counts_the_link(world):
    every = [_rank_row(1000.0 + r, 900.0 + 10 * (world - 1 - r), 1e-3 * (r + 1), 500.0 + r) for r in range(world)]
    link_bw = 400e9
    row = block_tp.merge_ranks(every, link_bw)
    assert row["compiled_us"] == 1000.0 + world - 1  # the last rank is the slowest compiled one
    assert row["compiled+fused_us"] == 900.0 + 10 * (world - 1)  # rank 0 the slowest fused one
    assert row["compiled+fused_per_rank_us"].split(" / ") == [f"{900.0 + 10 * (world - 1 - r):.1f}" for r in range(world)]
    assert row["fused_vs_compiled"] == pytest.approx(row["compiled_us"] / row["compiled+fused_us"])
    assert row["max_err"] == pytest.approx(1e-3 * world)
    link_us = 2 * (world - 1) / world * 4096 * 7168 * 2 / link_bw * 1e6
    assert row["link_floor_us"] == pytest.approx(link_us)
    assert row["rank_floor_us"] == pytest.approx(500.0 + world - 1 + link_us)
    assert row["fused_x_rank_floor"] == pytest.approx(row["compiled+fused_us"] / row["rank_floor_us"])
    assert set(block_tp.COLUMNS) <= set(row), set(block_tp.COLUMNS) - set(row)


def test_link_bytes_are_an_all_reduces():
    # R = 2 at M = 4096: each rank sends half of [M, H] twice (bench/results/tp.md moves 29.4 MB per exchange)
    assert block_tp.link_bytes(4096, 7168, 2) == 4096 * 7168 * 2
    assert block_tp.link_bytes(4096, 7168, 8) == pytest.approx(2 * 7 / 8 * 4096 * 7168 * 2)
    assert block_tp.link_bytes(8, 7168, 1) == 0


def test_the_sp_floor_runs_the_shared_expert_over_the_gathered_tokens():
    cfg = lmf.KimiK3MoEConfig.tiny()
    block = lmf.KimiK3MoEBlock(cfg, seed=0)
    x = torch.randn(6, cfg.hidden_size, dtype=block.w_up.dtype)
    flops_bound = {"copy_bytes_per_s": 1e30, "bf16_flop_per_s": 1e12}  # the floor is the FLOPs'
    alone = block_tp.local_floor_us(block, x, False, 4, flops_bound)
    sp = block_tp.local_floor_us(block, x, True, 4, flops_bound)
    inter_s = block.shared_w2.shape[1]
    assert sp - alone == pytest.approx(2 * 3 * 6 * 3 * cfg.hidden_size * inter_s / 1e12 * 1e6)
    assert block_tp.local_floor_us(block, x, True, 1, flops_bound) == pytest.approx(alone)


def test_results_per_world(tmp_path):
    assert [block_tp.results_name(w) for w in block_tp.WORLDS] == ["block_tp", "block_tp_4gpu", "block_tp_8gpu"]
    rows = [block_tp.merge_ranks([_rank_row(100.0, 90.0, 1e-3, 50.0, "SP")] * 4, 400e9)]
    rows[0]["kernels"] = {"compiled": [("k", 1.0), ("(all kernels)", 1.0)]}
    block_tp.write_world_results(rows, 4, {"copy_bytes_per_s": 4e12, "bf16_flop_per_s": 7e14}, 400e9, str(tmp_path))
    meta = json.loads((tmp_path / "block_tp_4gpu.json").read_text())["meta"]
    assert meta["world"] == 4 and meta["link_GBps"] == pytest.approx(400) and meta["floor"] == block_tp.FLOOR_RULE
    md = (tmp_path / "block_tp_4gpu.md").read_text()
    assert "link_floor_us" in md and "R = 4 GPUs" in md and "| SP | 4096 |" in md
    assert "SP M = 4096, compiled (rank 0)" in (tmp_path / "block_tp_4gpu_kernels.md").read_text()


def _record(rank, world, port, calls):
    calls.append((rank, world, port))


def test_launch_under_torchrun_runs_this_rank_in_this_process(monkeypatch):
    calls = []
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    launch_on_gpus(_record, 4, (calls,))
    assert calls == [(3, 4, None)]  # port None: torchrun's rendezvous
    with pytest.raises(SystemExit, match="--nproc-per-node 8"):
        launch_on_gpus(_record, 8, (calls,))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="one host"):
        launch_on_gpus(_record, 4, (calls,))


def test_launch_without_torchrun_spawns_one_process_per_gpu(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    spawned = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.multiprocessing, "spawn", lambda fn, args, nprocs, join: spawned.append((args, nprocs)))
    launch_on_gpus(_record, 8, ([],))
    assert len(spawned) == 1 and spawned[0][1] == 8 and spawned[0][0][0] == 8  # (world, port, *args), 8 processes
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit, match="needs 4 GPUs"):
        launch_on_gpus(_record, 4, ([],))


@pytest.mark.parametrize("argv, message", [(["--world", "3"], "one of"), (["--world", "4", "--prefill", "4098"],
                                                                            "equal SP token blocks")])
def test_bad_worlds_are_refused_before_any_gpu_work(monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["block_tp.py", *argv])
    with pytest.raises(SystemExit) as exc:
        block_tp.main()
    assert exc.value.code == 2 and message in capsys.readouterr().err
