"""The FP8 routed kernels' pieces on the CPU: the e2m1 -> e4m3 placement (its very PTX, emulated, every byte), the per-token
e4m3 split (numerics, k order, edge rows, bad inputs), the switch (the FP8 L1 by default) in the picked config, and the kernels'
static SASS for sm_90 (tests/fp8_compile_sm90.py: registers, spills, FP8 wgmmas from registers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from latent_moe_fusion.ops.common.mxfp4 import e2m1_lut
from latent_moe_fusion.ops.common.triton_compat import offline_budget
from latent_moe_fusion.ops.routed import producer_config as pc
from latent_moe_fusion.ops.routed.fp8_split import E4M3_MAX, MAX_SHIFT, split_e4m3, to_kappa_order
from latent_moe_fusion.ops.routed.gluon.fp8_mainloop import FP4_TO_E4M3_ASM
from tests.compiled_python import run_compiled
from tests.ptx_emulator import run_ptx

ROOT = Path(__file__).resolve().parent.parent


def _e4m3(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


def test_placement_gives_every_code_as_e4m3_times_2_to_the_minus_6():
    """$2: 4 bytes of 8 codes; $0: the low nibbles' codes, $1 the high ones', each byte the code's value / 64 as
    e4m3 (code 0.5 on e4m3's subnormal 2^-7, signed zeros kept): every byte value at every position."""
    values = e2m1_lut().tolist()
    for byte in range(256):
        for pos in range(4):
            word = (byte << (8 * pos)) | (0x5A << (8 * ((pos + 1) % 4)))  # other bytes: other codes
            lo, hi = run_ptx(FP4_TO_E4M3_ASM, {2: word}, 2)
            for out, code in ((lo, byte & 0xF), (hi, byte >> 4)):
                placed = (out >> (8 * pos)) & 0xFF
                got = _e4m3(placed)
                assert got == values[code] / 64, f"byte {byte:#04x} at {pos}: code {code} gave {got}"
                assert placed >> 7 == code >> 3  # the sign, -0 included


def test_kappa_order_puts_even_k_before_odd_k_in_each_32_block():
    k = torch.arange(96.0)[None]
    got = to_kappa_order(k)[0]
    block = torch.cat([torch.arange(0, 32, 2), torch.arange(1, 32, 2)]).float()
    assert torch.equal(got, torch.cat([block, block + 32, block + 64]))


def test_split_rebuilds_rows_of_any_magnitude():
    """hi + lo, times col_factor / 64, gives back each row in kappa order to within e4m3's range below its largest
    value; the largest value lands in [224, 448]."""
    z = torch.randn(6, 3584)
    z *= torch.tensor([1e-30, 1e-6, 1.0, 3.0, 1e6, 1e30])[:, None]
    z = z.to(torch.bfloat16)
    hi, lo, factor = split_e4m3(z)
    assert hi.dtype == lo.dtype == torch.float8_e4m3fn and factor.dtype == torch.float32
    back = (hi.double() + lo.double()) * factor[:, None].double() / 64
    ref = to_kappa_order(z.double())
    err = (back - ref).norm(dim=1) / ref.norm(dim=1)
    assert err.max() < 1e-4, err
    assert ((back == ref).float().mean(dim=1) > 0.85).all()
    top = hi.float().abs().amax(dim=1)
    assert ((top >= E4M3_MAX / 2) & (top <= E4M3_MAX)).all(), top  # 224: just above 1.75 * 2^7, rounded
    one_part = ((hi.double() * factor[:, None].double() / 64 - ref).norm(dim=1) / ref.norm(dim=1))
    assert (one_part > 1e-2).all()  # one e4m3 part alone keeps 4 bits: why there are two


def test_split_of_a_zero_row_and_a_lone_outlier():
    z = torch.zeros(2, 64, dtype=torch.bfloat16)
    z[1, 7] = -E4M3_MAX
    hi, lo, factor = split_e4m3(z)
    assert not hi[0].float().any() and not lo[0].float().any()
    assert factor[0].item() == 2.0 ** (6 - MAX_SHIFT)
    assert factor[1].item() == 64.0 and hi[1].float().min().item() == -E4M3_MAX


@pytest.mark.parametrize("bad, what", [(torch.zeros(2, 64), "bfloat16"), (torch.zeros(2, 2, 64, dtype=torch.bfloat16),
                                       "tokens, K"), (torch.zeros(2, 48, dtype=torch.bfloat16), "multiple of 32")])
def test_split_rejects_bad_inputs(bad, what):
    with pytest.raises(ValueError, match=what):
        split_e4m3(bad)


def test_fp8_config_must_be_whole_k_register_kernels_on_8_row_blocks():
    tiles = pc.GemmTiles(64, 128, 4, 4)
    with pytest.raises(ValueError, match="bm=8"):
        pc.ProducerConfig(16, tiles, tiles, routed_regs=True, routed_fp8=(True, True))
    with pytest.raises(ValueError, match="regs_split"):
        pc.ProducerConfig(8, tiles, tiles, routed_regs=True, regs_split=(2, 2), routed_fp8=(True, False))
    with pytest.raises(ValueError, match="L2 only with L1"):
        pc.ProducerConfig(8, tiles, tiles, routed_regs=True, routed_fp8=(False, True))
    assert pc.ProducerConfig(8, tiles, tiles, routed_regs=True, routed_fp8=(True, True)).routed_fp8 == (True, True)


def test_the_switch_says_what_it_takes(monkeypatch):
    monkeypatch.setenv(pc.ROUTED_FP8_ENV, "yes")
    with pytest.raises(ValueError, match="expected one of 0, 1, l1,l2 .*0: neither, the bf16 kernels"):
        pc.routed_fp8_layers()


@pytest.mark.parametrize("flag, layers", [(None, (True, False)), ("1", (True, False)), ("l1,l2", (True, True))])
@pytest.mark.parametrize("tokens, fp8", [(1, False), (8, True), (32, True), (128, False), (4096, False)])
def test_the_switch_picks_fp8_at_decode_only(tokens, fp8, flag, layers, monkeypatch):
    """On a Hopper GPU, unset (the default: the L1) or LMF_ROUTED_FP8=1 (or l1,l2): the picked decode configs of the
    register-dequant kernels take the FP8 L1 (and L2) in 8-row blocks where the grouping would take 16 rows (not a
    single token's K-sliced kernels nor its GEMV, nor 32-row decode blocks, nor prefill); 0, never."""
    monkeypatch.setattr(pc, "_is_hopper", lambda: True)
    monkeypatch.setattr(pc, "_has_sm90", lambda: True)
    monkeypatch.setattr(pc, "interpreting", lambda: False)
    assert pc.ROUTED_FP8_ENV in pc.CONFIG_ENVS
    monkeypatch.setenv(pc.ROUTED_FP8_ENV, "0")
    assert not any(pc.pick_config(tokens * 16, "mxfp4", torch.bfloat16, 112).routed_fp8)
    if flag is None:
        monkeypatch.delenv(pc.ROUTED_FP8_ENV)
    else:
        monkeypatch.setenv(pc.ROUTED_FP8_ENV, flag)
    assert pc.routed_fp8_forced() == (flag is not None)
    cfg = pc.pick_config(tokens * 16, "mxfp4", torch.bfloat16, 112)
    assert cfg.routed_fp8 == (layers if fp8 else (False, False)) and (cfg.bm == pc.FP8_BLOCK_M) == fp8, cfg


@pytest.mark.parametrize("flag", [None, "1"])
def test_a_default_fp8_pick_falls_back_to_the_bf16_kernels_where_they_cannot_run(flag, monkeypatch):
    """Unset, the FP8 L1 is a default: a call its kernels cannot take (here: no sm_90 device) gets the bf16
    kernels' config and grouping (16 rows at 8 tokens of the Kimi K3 rank); set, the plan raises and says why; a
    given config is never changed: the plan says why it cannot run."""
    from latent_moe_fusion.ops.routed.routed_plan import RoutedCall, plan_for

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if flag is None:
        monkeypatch.delenv(pc.ROUTED_FP8_ENV, raising=False)
    else:
        monkeypatch.setenv(pc.ROUTED_FP8_ENV, flag)
    tiles = pc.GemmTiles(64, 128, 4, 4)
    cfg = pc.ProducerConfig(pc.FP8_BLOCK_M, tiles, tiles, routed_regs=True, routed_fp8=(True, False))
    call = RoutedCall(8, 16, 112, 512, 256, "mxfp4", torch.bfloat16, None)
    if flag is None:
        plan = plan_for(call, cfg, given=False)
        assert plan.config.routed_fp8 == (False, False) and plan.config.bm == pc.decode_block_m(8 * 16, 112) == 16
        assert plan.family == "triton" and "FP8 blocks dropped (needs an sm_90 GPU" in plan.lines()[2], plan.lines()
    else:
        with pytest.raises(ValueError, match=f"{pc.ROUTED_FP8_ENV}: the FP8 routed kernels cannot take this call "
                                             r"\(needs an sm_90 GPU"):
            plan_for(call, cfg, given=False)
    with pytest.raises(ValueError, match=r"config.routed_regs: the register-dequant kernels cannot take this call"):
        plan_for(call, cfg, given=True)


def test_fp8_kernels_compile_for_sm90_within_4_ctas_per_sm(tmp_path):
    done = run_compiled([str(ROOT / "tests" / "fp8_compile_sm90.py"), "--out", str(tmp_path)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "fp8_sass.json").read_text())
    l1 = [r for r in rows if r["kernel"] == "l1_fp8_kernel"]
    # 8-row blocks: one K loop (8-row MMAs); 16-row blocks: an 8- and a 16-row path
    assert [(r["block_rows"], r["mma"].split(".")[1]) for r in l1] == [(8, "64x8x32"), (16, "64x8x32"),
                                                                         (16, "64x16x32")], l1
    for r in l1:
        assert r["mma"].startswith("QGMMA") and r["mma"].endswith("E4M3.E4M3") and r["wgmma"] == 16, r
        assert r["spills"] == 0 and r["HMUL2"] == 0 and r["BAR"] <= offline_budget("fp8_barriers_per_step", 2), r
    eight = l1[0]
    assert eight["registers"] <= offline_budget("fp8_l1_8_registers", 128), eight  # 128: 4 CTAs of 4 warps per SM
    assert eight["FFMA"] == 32 and eight["loop_instr"] < 300, eight  # the bf16 L1: 385 per step
    l2 = [r for r in rows if r["kernel"] == "l2_regs_kernel"]
    assert len(l2) == 1 and l2[0]["mma"].startswith("HGMMA.64x8x16") and l2[0]["spills"] == 0, l2
    l2_fp8 = [r for r in rows if r["kernel"] == "l2_fp8_kernel"]
    assert len(l2_fp8) == 1 and l2_fp8[0]["mma"].startswith("QGMMA.64x8x32") and l2_fp8[0]["wgmma"] == 8, l2_fp8
    assert l2_fp8[0]["spills"] == 0 and l2_fp8[0]["registers"] <= 80, l2_fp8  # 3 CTAs of 8 warps, as the bf16 L2
    assert l2_fp8[0]["loop_instr"] < l2[0]["loop_instr"], (l2_fp8, l2)


def test_the_launchers_reject_what_the_kernels_cannot_take():
    """Checked before any launch (CPU tensors suffice): the split kernel's input and live rows, the FP8 kernels'
    block rows, K and MMA schedule (an unknown one would otherwise run the "block" schedule)."""
    from latent_moe_fusion.ops.routed.gluon import launch_routed_l1_fp8, launch_routed_l2_fp8
    from latent_moe_fusion.ops.routed.triton.fp8_split_kernel import launch_split_e4m3

    with pytest.raises(ValueError, match="bfloat16"):
        launch_split_e4m3(torch.zeros(2, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        launch_split_e4m3(torch.zeros(2, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="one entry per row"):
        launch_split_e4m3(torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int32))
    part = torch.zeros(8, 512, dtype=torch.float8_e4m3fn)
    factor, ids = torch.ones(8), torch.zeros(8, dtype=torch.int32)
    w13, s13 = torch.zeros(2, 2 * 256, 256, dtype=torch.uint8), torch.zeros(2, 2 * 256, 16, dtype=torch.uint8)
    act = torch.zeros(64, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"blocks of \(8, 16, 32\) rows \(got 64\)"):
        launch_routed_l1_fp8(part, part, factor, w13, s13, ids, ids, act, 1, 64, 8, 4.0, 25.0)
    with pytest.raises(ValueError, match=r"mma='step': the FP8 kernels schedule their MMAs as one of \('pipe', 'block'\)"):
        launch_routed_l1_fp8(part, part, factor, w13, s13, ids, ids, act, 1, 8, 8, 4.0, 25.0, mma="step")
    w2, s2 = torch.zeros(2, 512, 128, dtype=torch.uint8), torch.zeros(2, 512, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="K = 256 a multiple of 512"):
        launch_routed_l2_fp8(part[:, :256], part[:, :256], factor, w2, s2, ids, ids, torch.zeros(8, 512), 1, 8)


@pytest.mark.parametrize("latent, inter, flag, layer", [(256, 512, "1", "L1: the latent size 256"),
                                                        (512, 256, "l1,l2", "L2: the intermediate size 256")])
def test_an_fp8_layer_asked_for_whose_k_it_cannot_take_says_so(latent, inter, flag, layer, monkeypatch):
    """The FP8 kernels take K in whole rounds of their rings (FP8_K_MULTIPLE). Unset, the default FP8 L1 quietly
    leaves other K to the bf16 kernels; set, the picked config raises and names the layer and K instead of
    running the bf16 kernels behind the flag's back."""
    from latent_moe_fusion.ops.routed.gluon import FP8_K_MULTIPLE
    from latent_moe_fusion.ops.routed.schedule_rules import resolve_config

    monkeypatch.setattr(pc, "_is_hopper", lambda: True)
    monkeypatch.setattr(pc, "_has_sm90", lambda: True)
    monkeypatch.setattr(pc, "interpreting", lambda: False)
    experts, tokens = 112, 8
    z = torch.randn(tokens, latent).to(torch.bfloat16)
    w13 = torch.zeros(experts, 2 * inter, latent // 2, dtype=torch.uint8)
    w2 = torch.zeros(experts, latent, inter // 2, dtype=torch.uint8)

    def resolve():
        return resolve_config(z, tokens * 16, experts, "mxfp4", inter, None, None, w13, w2)

    monkeypatch.delenv(pc.ROUTED_FP8_ENV, raising=False)
    unset = resolve()
    assert unset.routed_fp8 == ((True, False) if latent % FP8_K_MULTIPLE == 0 else (False, False)), unset
    monkeypatch.setenv(pc.ROUTED_FP8_ENV, flag)
    with pytest.raises(ValueError, match=rf"{pc.ROUTED_FP8_ENV}: the FP8 routed kernels cannot take this call "
                                         rf"\({layer} is not a multiple of {FP8_K_MULTIPLE}\); unset"):
        resolve()
