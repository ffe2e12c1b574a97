"""The shared expert's one-launch gate/up + SiTU (ops/shared_gate_up.py) on CPU: its kernel through
TRITON_INTERPRET=1 (set by conftest.py) against float64 with NaN-poisoned outputs, the knob's parser and table,
and the reasons it stands aside."""

import json

import pytest
import torch

from latent_moe_fusion.ops.math import situ
from latent_moe_fusion.ops.shared_gate_up import (
    SHARED_GATE_UP_ENV,
    TABLE,
    GateUpConfig,
    gate_up_act,
    gate_up_config,
    parse_label,
    why_not,
)
from tests.compiled_python import run_compiled

interpreter_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU only")
BETA, LIN_BETA = 1.5, 3.0


def _operands(m: int, k: int, inter: int):
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w1 = torch.randn(inter, k, dtype=torch.bfloat16) * k**-0.5 * 3
    w3 = torch.randn(inter, k, dtype=torch.bfloat16) * k**-0.5 * 3
    return x, w1, w3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.norm())


@interpreter_only
@pytest.mark.parametrize("cfg", [GateUpConfig(16, 32, 64), GateUpConfig(32, 64, 32, num_stages=2)],
                         ids=lambda c: c.label())
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("k", [192, 200])
def test_kernel_against_float64(cfg, m, k, rng_seed):
    # I_s = 40 is not a multiple of the tiles' 16 / 32 rows: clamped rows, masked stores; K = 200: a masked K tail
    x, w1, w3 = _operands(m, k, 40)
    act = torch.full((m, 40), float("nan"), dtype=torch.bfloat16)
    gate_up_act(x, w1, w3, act, BETA, LIN_BETA, cfg)
    assert not act.isnan().any()
    g, u = (x.double() @ w.double().t() for w in (w1, w3))
    assert _rel(act, situ(g, u, BETA, LIN_BETA)) < 1.5e-2
    # the library path's roundings: gate and up products in bf16, SiTU in FP32, rounded to bf16
    library = situ(g.to(torch.bfloat16), u.to(torch.bfloat16), BETA, LIN_BETA).to(torch.bfloat16)
    assert _rel(act, library) < 8e-3


@interpreter_only
def test_rows_past_m_are_not_written(rng_seed):
    x, w1, w3 = _operands(3, 64, 16)
    act = torch.full((5, 16), float("nan"), dtype=torch.bfloat16)
    gate_up_act(x, w1, w3, act[:3], BETA, LIN_BETA, GateUpConfig(16, 32, 32, num_stages=1))
    assert not act[:3].isnan().any() and act[3:].isnan().all()


def test_a_config_refuses_more_tokens_than_it_pads_to():
    x, w1, w3 = _operands(17, 64, 16)
    with pytest.raises(ValueError, match="serves up to 16 tokens, got M = 17"):
        gate_up_act(x, w1, w3, torch.empty(17, 16), BETA, LIN_BETA, GateUpConfig(16, 32, 64))


@pytest.mark.parametrize("cfg", [cfg for _, cfg in TABLE], ids=lambda c: c.label())
def test_labels_name_their_configs(cfg):
    assert parse_label(cfg.label()) == cfg


@pytest.mark.parametrize("value, says", [
    ("yes", "expected cublas, triton or a config label"),
    ("16x32x256", "expected cublas, triton or a config label"),
    ("24x32x256/w4/st4", "block_m = 24 is not a power of two"),
    ("16x32x256/w3/st4", "num_warps = 3 is not a power of two"),
    ("16x16x256/w4/st4", "block_n >= 32"),
    ("16x32x256/w4/st0", "stages 1 .. 8"),
])
def test_bad_values_say_what_is_accepted(monkeypatch, value, says):
    monkeypatch.setenv(SHARED_GATE_UP_ENV, value)
    with pytest.raises(ValueError, match=f"{SHARED_GATE_UP_ENV}=.*{says}"):
        gate_up_config(8)


def test_knob_values(monkeypatch):
    monkeypatch.setenv(SHARED_GATE_UP_ENV, "triton")
    low = 0
    for high, cfg in TABLE:
        for m in (low + 1, high):
            assert gate_up_config(m) == cfg and cfg.block_m >= m
        low = high
    assert gate_up_config(TABLE[-1][0] + 1) is None
    monkeypatch.setenv(SHARED_GATE_UP_ENV, "cublas")
    assert gate_up_config(8) is None
    monkeypatch.setenv(SHARED_GATE_UP_ENV, "32x64x128/w8/st3")
    assert gate_up_config(32) == GateUpConfig(32, 64, 128, 8, 3) and gate_up_config(33) is None


def test_it_stands_aside_with_a_reason():
    x, w1, w3 = _operands(8, 64, 16)
    assert "Hopper" in why_not(x, w1, w3)  # CPU tensors


_COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from latent_moe_fusion.ops.shared_gate_up import TABLE
from latent_moe_fusion.ops.triton_kernels.shared_gate_up import shared_gate_up_kernel
shared = {}
for _, c in TABLE:
    sig = {"x_desc": f"tensordesc<bf16[{c.block_m},{c.block_k}]>", "w1_ptr": "*bf16", "w3_ptr": "*bf16",
           "act_ptr": "*bf16", "M": "i32", "INTER": "i32", "K": "i32", "s_w1": "i32", "s_w3": "i32", "s_actm": "i32",
           "beta": "fp32", "lin_beta": "fp32"}
    consts = dict(BLOCK_N=c.block_n, BLOCK_M=c.block_m, BLOCK_K=c.block_k, EVEN_K=True, DOT_FP32=False,
                  PRECISION="tf32", INTERPRET=False)
    sig |= {n: "constexpr" for n in consts}
    kernel = triton.compile(ASTSource(fn=shared_gate_up_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": c.num_warps, "num_stages": c.num_stages})
    shared[c.label()] = kernel.metadata.shared
print(json.dumps(shared))
"""


def test_the_table_compiles_for_sm90_beside_a_down_projection_program():
    """GPU-only compile errors surface here (the interpreter runs no PTX); each config's shared memory leaves an
    SM room for one of the down-projection's programs (147 KB at 6 stages) beside it."""
    done = run_compiled(["-c", _COMPILE], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(shared) == {cfg.label() for _, cfg in TABLE}
    assert all(0 < b <= (227 - 147) * 1024 for b in shared.values()), shared
