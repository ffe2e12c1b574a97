"""bench/block.py's floors and ratio ceiling on CPU: the two parts of the block count every weight once, and
the ceiling (the largest compiled / fused over every speed of the shared routed kernels) matches a
brute-force scan of that speed."""

import pytest

from bench.block import ratio_ceiling, ratios_with_routed_as_measured


def _scan(routed_us, routed_floor_us, fixed, serial, block_floor):
    steps = 20000
    best = 0.0
    for i in range(steps + 1):
        r = routed_floor_us + (routed_us - routed_floor_us) * i / steps
        best = max(best, (r + fixed) / max(r + serial, block_floor))
    return best


@pytest.mark.parametrize("case", [
    (326.0, 197.6, 102.0, 26.2, 234.2),   # M = 128-like: the knee inside the interval
    (197.0, 121.6, 99.8, 25.2, 157.8),    # M = 32-like
    (50.0, 45.0, 80.0, 24.0, 87.0),       # the knee below the routed floor
    (300.0, 100.0, 10.0, 30.0, 150.0),    # fixed < serial: the ratio rises with r beyond the knee
])
def test_matches_a_scan(case):
    assert ratio_ceiling(*case) == pytest.approx(_scan(*case), rel=1e-4)


def test_a_baseline_that_only_shares_kernels_bounds_the_ratio():
    # rewritten work of 92 us in the baseline can at most be hidden: ratio <= 1 + fixed / block floor
    assert ratio_ceiling(326.0, 197.6, 92.0, 26.2, 234.2) <= 1 + 92.0 / 234.2


def test_the_two_parts_count_every_weight_once(rng_seed):
    """With every local expert hit, untouched + rewritten bytes are all parameters plus x read and out written."""
    import torch

    import latent_moe_fusion as lmf
    from bench.block import block_parts_bytes_and_flops

    cfg = lmf.KimiK3MoEConfig.tiny()
    block = lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cpu", seed=0,
                               router_gemm="bf16", ep_size=2, ep_rank=1)
    x = torch.randn(512, cfg.hidden_size, dtype=torch.bfloat16)
    parts = block_parts_bytes_and_flops(block, x)
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    act = x.numel() * x.element_size()
    assert parts["untouched"][0] + parts["rewritten"][0] == params + 2 * act
    m, h, lat = x.shape[0], cfg.hidden_size, cfg.latent_size
    # the rewritten FLOPs: down- and up-projection, shared gate, up and down
    assert parts["rewritten"][1] == 2 * m * (2 * lat * h + 3 * h * block.shared_w2.shape[1])


def test_ratios_with_routed_as_measured_bracket_the_fused_block():
    """M = 32 of a measured block (us): compiled 282.5, fused 238.4, routed 189.95, router GEMM 10.24, the
    rewritten part's floor 32.98, the projections' 25.2. In a row at floor < hidden, and that run's fused block
    lies below both."""
    in_a_row, hidden = ratios_with_routed_as_measured(282.5, 189.95, 10.24, 32.98, 25.2)
    assert in_a_row == pytest.approx(282.5 / (189.95 + 10.24 + 32.98))
    assert hidden == pytest.approx(282.5 / (189.95 + 25.2))
    assert 282.5 / 238.4 < in_a_row < hidden
    assert in_a_row < 1.3 < hidden  # 1.3x needs the rest hidden, not merely at its floor
