"""Triton moe_shared_producer at tiny sizes (TRITON_INTERPRET=1 on CPU, native on a GPU)."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.common.backends import backends_for
from latent_moe_fusion.ops.routed import expert_schedule
from latent_moe_fusion.ops.routed import expert_triton_backend as routed_backend
from latent_moe_fusion.ops.routed import producer_triton_backend as producer_backend
from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, run_experts
from latent_moe_fusion.ops.routed.producer_config import GemmTiles, ProducerConfig, pick_config
from tests.expert_problems import make_problem, rel_l2, tolerance
from tests.launch_spy import LaunchSpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = dict(latent=64, inter=32, num_experts=8, top_k=4, hidden=64, inter_s=32)


@pytest.mark.parametrize(
    "weight_format,dtype,routing",
    [("bf16", torch.bfloat16, "random"), ("mxfp4", torch.bfloat16, "few_experts"), ("bf16", torch.float32, "random")],
)
def test_producer_matches_reference(weight_format, dtype, routing, rng_seed):
    p = make_problem(11, weight_format=weight_format, dtype=dtype, routing=routing, device=DEVICE, **SIZES)
    y_out = torch.full_like(p.z, float("nan"))
    s_out = torch.full_like(p.x_s, float("nan"))
    shared = SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out)
    y_n = run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=1e-5, shared=shared, out=y_out)
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y_n, ref_y) < tolerance(dtype)
    assert rel_l2(s_out, ref_s) < tolerance(dtype)


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_narrow_shared_tiles_cover_every_column(weight_format, rng_seed):
    # Shared-expert programs narrower than the routed ones (bn_shared < bn), widths that leave a
    # partial last shared tile in both GEMMs (I_s = 48, H = 80 with bn_shared = 32; K stays a
    # multiple of the K tile, as the kernels require): outputs poisoned.
    sizes = dict(SIZES, inter_s=48, hidden=80)
    p = make_problem(9, weight_format=weight_format, device=DEVICE, **sizes)
    base = pick_config(9 * sizes["top_k"], weight_format, torch.bfloat16)
    cfg = ProducerConfig(16, GemmTiles(64, 32, 4, 1, bk_shared=16, bn_shared=32),
                         GemmTiles(64, 32, 4, 1, bk_shared=16, bn_shared=32), base.dequant)
    y_out = torch.full_like(p.z, float("nan"))
    s_out = torch.full_like(p.x_s, float("nan"))
    y_n = run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=1e-5,
                      shared=SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out), out=y_out, config=cfg)
    ref_y, ref_s = p.reference_producer()
    assert torch.isfinite(s_out).all() and torch.isfinite(y_n).all()
    assert rel_l2(y_n, ref_y) < tolerance(torch.bfloat16)
    assert rel_l2(s_out, ref_s) < tolerance(torch.bfloat16)


def test_producer_backend_layouts_on_one_rank(rng_seed):
    p = make_problem(6, device=DEVICE, **SIZES)
    ref_y, ref_s = p.reference_producer()
    shapes = {"local": (1, 6, 64), "token_publish": (6, 1, 64), "hidden_scatter": (1, 6, 64)}
    for mode, shape in shapes.items():
        y_n, ws = producer_backend.moe_shared_producer_triton(*p.producer_args(mode))
        assert tuple(ws.shape) == shape
        assert rel_l2(y_n, ref_y) < tolerance(torch.bfloat16)
        assert rel_l2(ws.reshape(6, 64), ref_s) < tolerance(torch.bfloat16)


def test_backends_registered_for_cuda():
    for op in ("routed_experts", "moe_shared_producer"):
        (triton_backend,) = [b for b in backends_for(op) if b.name == "triton"]
        assert triton_backend.priority == 10 and triton_backend.device_types == ("cuda",)


def test_supports_names_the_problem():
    p = make_problem(4, device="cpu", **SIZES)
    assert routed_backend._supports(*p.routed_args()) is None
    assert producer_backend._supports(*p.producer_args()) is None
    odd = make_problem(4, latent=40, inter=32, num_experts=8, top_k=4, hidden=64, inter_s=32)
    assert "multiples of 16" in routed_backend._supports(*odd.routed_args())
    odd_shared = make_problem(4, latent=64, inter=32, num_experts=8, top_k=4, hidden=72, inter_s=32)
    assert "H = 72" in producer_backend._supports(*odd_shared.producer_args())


@pytest.mark.parametrize("value", ["16", "16x", "axb", "24x128", "8x128"])
def test_shared_tile_override_rejects_bad_values(tuned, value):
    from latent_moe_fusion.ops.routed.producer_config import SHARED_TILES_OVERRIDE

    with pytest.raises(ValueError, match=SHARED_TILES_OVERRIDE):
        tuned(producer_decode_shared_tiles=value)


def test_shared_tile_override_is_read(tuned):
    from latent_moe_fusion.ops.routed.producer_config import decode_shared_tiles

    tuned(producer_decode_shared_tiles="16x128")
    assert decode_shared_tiles() == (16, 128)


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_weight_tiles_through_tensor_descriptors(weight_format, rng_seed):
    # GemmTiles.tma: routed weight tiles by bulk copy over the [E * rows, K] view; partial tiles at the
    # end of an expert read the next expert's rows (or zeros past the tensor) and must not leak in.
    from dataclasses import replace

    p = make_problem(7, weight_format=weight_format, device=DEVICE, **SIZES)
    base = pick_config(7 * SIZES["top_k"], weight_format, torch.bfloat16)
    cfg = replace(base, l1=replace(base.l1, tma=True), l2=replace(base.l2, tma=True))
    y_out = torch.full_like(p.z, float("nan"))
    s_out = torch.full_like(p.x_s, float("nan"))
    y_n = run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=1e-5,
                      shared=SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out), out=y_out, config=cfg)
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y_n, ref_y) < tolerance(torch.bfloat16)
    assert rel_l2(s_out, ref_s) < tolerance(torch.bfloat16)


def test_tensor_descriptor_tiles_refuse_unaligned_rows(rng_seed):
    from dataclasses import replace

    sizes = dict(SIZES, latent=36)  # BF16 rows of 72 bytes: not a multiple of 16 (MXFP4 rows always are)
    p = make_problem(3, weight_format="bf16", device=DEVICE, **sizes)
    base = pick_config(3 * sizes["top_k"], "bf16", torch.bfloat16)
    cfg = replace(base, l1=replace(base.l1, tma=True))
    with pytest.raises(ValueError, match="tma=False"):
        run_experts(*p.routed_args(), config=cfg)


@pytest.mark.parametrize("weight_format,shared", [("mxfp4", True), ("bf16", False)], ids=["producer", "routed_only"])
def test_split_k_matches_reference_and_is_deterministic(weight_format, shared, rng_seed):
    # L1 in 3 K slices, L2 in 4: with K = 64 in tiles of 32 the last slice of L1 and the last two of
    # L2 are empty (they must add 0). Outputs poisoned; two runs bitwise equal (slices summed in order).
    p = make_problem(9, weight_format=weight_format, device=DEVICE, **SIZES)
    base = pick_config(9 * SIZES["top_k"], weight_format, torch.bfloat16)
    cfg = ProducerConfig(16, GemmTiles(32, 32, 4, 1, split_k=3), GemmTiles(32, 32, 4, 1, split_k=4), base.dequant)
    runs = []
    for _ in range(2):
        y_out = torch.full_like(p.z, float("nan"))
        s_out = torch.full_like(p.x_s, float("nan"))
        sh = SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out) if shared else None
        y = run_experts(*p.routed_args(), rms_weight=p.rms_weight if shared else None, eps=1e-5, shared=sh,
                        out=y_out, config=cfg)
        runs.append((y.clone(), s_out.clone()))
    (y, s_out), (y2, s2) = runs
    assert torch.equal(y, y2) and (not shared or torch.equal(s_out, s2))
    if shared:
        ref_y, ref_s = p.reference_producer()
        assert rel_l2(s_out, ref_s) < tolerance(torch.bfloat16)
    else:
        ref_y = p.reference_routed()
    assert rel_l2(y, ref_y) < tolerance(torch.bfloat16)


def test_split_k_must_be_positive():
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        GemmTiles(64, 64, 4, 1, split_k=0)


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_shared_expert_by_library_between_the_routed_grids(weight_format, monkeypatch, tuned, rng_seed):
    """grid_shared="cublas": the routed grids run alone and the shared expert as library GEMMs, launched
    after the routed L1 (so that their host time overlaps L1 outside CUDA graphs); the fragments and the
    normalised routed output match the reference and the one-grid path."""
    from latent_moe_fusion.ops.routed import expert_schedule as es

    p = make_problem(9, weight_format=weight_format, routing="few_experts", device=DEVICE, **SIZES)
    launches = []

    class Recorded:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            launch = self.kernel[grid]

            def run(*args, **kwargs):
                launches.append(self.name)
                return launch(*args, **kwargs)

            return run

    def library(*args, **kwargs):
        launches.append("shared")
        return shared_by_library(*args, **kwargs)

    shared_by_library = es.shared_by_library
    monkeypatch.setattr(es, "shared_by_library", library)
    monkeypatch.setattr(es, "l1_kernel", Recorded(es.l1_kernel, "l1"))
    monkeypatch.setattr(es, "l2_kernel", Recorded(es.l2_kernel, "l2"))

    def run():
        y = torch.full_like(p.z, float("nan"))
        s_out = torch.full_like(p.x_s, float("nan"))
        run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=1e-5, out=y,
                    shared=SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out))
        return y, s_out

    tuned(grid_shared="cublas")
    y, s_out = run()
    assert launches == ["l1", "shared", "l2"]
    tuned(grid_shared="grid")
    y_grid, s_grid = run()
    assert launches[3:] == ["l1", "l2"]
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(s_out, ref_s) < tolerance(torch.bfloat16) and rel_l2(y, ref_y) < tolerance(torch.bfloat16)
    assert torch.equal(y, y_grid)  # the routed rows do not depend on where the shared expert ran
    assert rel_l2(s_out, s_grid) < tolerance(torch.bfloat16)


def test_grid_shared_override_rejects_unknown_values(tuned):
    from latent_moe_fusion.ops.routed.schedule_rules import GRID_SHARED_MAX_TOKENS, grid_shared_strategy

    assert grid_shared_strategy(1) == grid_shared_strategy(GRID_SHARED_MAX_TOKENS) == "grid"
    assert grid_shared_strategy(GRID_SHARED_MAX_TOKENS + 1) == "cublas"
    tuned(grid_shared="grid")
    assert grid_shared_strategy(4096) == "grid"
    with pytest.raises(ValueError, match="grid_shared='side': expected one of grid, cublas"):
        tuned(grid_shared="side")


@pytest.mark.parametrize("weight_format", ["bf16", "mxfp4"])
def test_int64_offsets_change_no_value(weight_format, monkeypatch, rng_seed):
    """LARGE_OFFSETS (int64 row offsets in the Triton grids, set where the activation rows or another operand reach
    past int32) reaches both launches and computes the same bits as the int32 build, routed and shared tiles alike:
    here forced on at a small size."""
    p = make_problem(11, weight_format=weight_format, device=DEVICE, **SIZES)
    seen = []
    for kernel in ("l1_kernel", "l2_kernel"):
        monkeypatch.setattr(expert_schedule, kernel, LaunchSpy(getattr(expert_schedule, kernel), "LARGE_OFFSETS", seen))
    outs = []
    for large in (False, True):
        monkeypatch.setattr(expert_schedule, "needs_int64_offsets", lambda *tensors, large=large: large)
        s_out = torch.full_like(p.x_s, float("nan"))
        y = run_experts(*p.routed_args(), rms_weight=p.rms_weight, eps=1e-5, out=torch.full_like(p.z, float("nan")),
                        shared=SharedExpert(p.x_s, p.w1_s, p.w3_s, p.w2_s, s_out))
        outs.append((y, s_out))
    assert seen == [False, False, True, True]
    (y0, s0), (y1, s1) = outs
    assert torch.isfinite(y1).all() and torch.isfinite(s1).all()
    assert torch.equal(y0, y1) and torch.equal(s0, s1)
    ref_y, ref_s = p.reference_producer()
    assert rel_l2(y1, ref_y) < tolerance(torch.bfloat16) and rel_l2(s1, ref_s) < tolerance(torch.bfloat16)
