"""The lmf::moe_shared_producer -> DeepGEMM MegaMoE mapping, on the CPU against a fake deep_gemm.

The fake checks every argument as DeepGEMM's host code does and computes what the kernel computes
from the bytes it receives, so these tests check both the argument contract and the data
mapping (FP4 bytes, E8M0 scales, gate/up interleave, FP8 staging, expert-id offsets, the three
fragment layouts). They say nothing about the real kernel, which has not run here.
"""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.common.mxfp4 import quantize_mxfp4
from latent_moe_fusion.ops.common.reference_math import rms_norm_math, routed_experts_math, shared_expert_math
from latent_moe_fusion.ops.routed import deepgemm
from latent_moe_fusion.ops.routed.deepgemm import agree, sm100_mega_moe, sm100_state
from latent_moe_fusion.ops.routed.deepgemm import weight_cache as weights
from latent_moe_fusion.ops.routed.deepgemm.formats import (
    dequantize_fp8_ue8m0,
    e8m0_as_float,
    pack_ue8m0,
    quantize_fp8_ue8m0,
    unpack_ue8m0,
)
from latent_moe_fusion.ops.routed.deepgemm.probe import probe_deepgemm
from tests.deepgemm_fake import FakeDeepGemm, install

E, L, INTER, K, H, I_S = 4, 128, 128, 3, 64, 64
BETA, LIN_BETA, EPS = 4.0, 25.0, 1e-5


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm())


@pytest.fixture
def fake(monkeypatch):
    f = FakeDeepGemm()
    install(monkeypatch, f, (10, 0))
    monkeypatch.setenv(sm100_mega_moe.FP8_OPT_IN, "1")
    yield f
    deepgemm.reset_deepgemm_state()


def routed_weights_():
    w13, s13 = quantize_mxfp4(torch.randn(E, 2 * INTER, L) * 0.1)
    w2, s2 = quantize_mxfp4(torch.randn(E, L, INTER) * 0.1)
    return w13, w2, s13, s2


def shared_weights_():
    return tuple((torch.randn(shape) * 0.1).to(torch.bfloat16) for shape in ((I_S, H), (I_S, H), (H, I_S)))


def routing(m):
    ids = torch.stack([torch.randperm(E + 2)[:K] - 2 for _ in range(m)]).clamp_min(-1).to(torch.int32)
    return ids, torch.rand(m, K)


def producer_args(z, ids, w, routed, x_s, shared, rms_weight, mode, group_name):
    w13, w2, s13, s2 = routed
    return (z, ids, w, w13, w2, s13, s2, "mxfp4", BETA, LIN_BETA, rms_weight, EPS, x_s, *shared, mode, group_name)


def fp8_roundtrip(z):
    return dequantize_fp8_ue8m0(*quantize_fp8_ue8m0(z)).to(torch.bfloat16)


def expected_y(z, ids, w, routed, rms_weight):
    """The contract's y_n, computed on the FP8-staged activations the kernel reads."""
    w13, w2, s13, s2 = routed
    y = routed_experts_math(fp8_roundtrip(z), ids, w, w13, w2, s13, s2, "mxfp4", BETA, LIN_BETA)
    return rms_norm_math(y, rms_weight, EPS)


def test_formats_roundtrip():
    z = torch.randn(5, 256, dtype=torch.bfloat16) * 3
    values, sf = quantize_fp8_ue8m0(z)
    assert values.dtype == torch.float8_e4m3fn and sf.dtype == torch.int32 and tuple(sf.shape) == (5, 2)
    back = dequantize_fp8_ue8m0(values, sf)
    assert rel_l2(back, z) < 0.05  # e4m3: 3 mantissa bits
    bytes_ = torch.randint(0, 255, (3, 8), dtype=torch.uint8)
    assert torch.equal(unpack_ue8m0(pack_ue8m0(bytes_)), bytes_)
    assert torch.equal(e8m0_as_float(torch.tensor([127, 128, 120], dtype=torch.uint8)),
                       torch.tensor([1.0, 2.0, 2.0**-7]))


def test_local_mode_maps_onto_bf16_shared(fake):
    m = 5
    routed, shared = routed_weights_(), shared_weights_()
    rms_weight = (1 + 0.1 * torch.randn(L)).to(torch.bfloat16)
    state = deepgemm.prepare_deepgemm_producer(
        mode="local", group_name=None, num_experts=E, max_tokens=8, top_k=K, latent=L, inter=INTER, hidden=H,
        shared_inter=I_S, device="cpu", weights=(*routed, *shared),
    )
    assert state is not None and fake.count("get_symm_buffer_for_mega_moe") == 1
    assert fake.count("transform_weights_for_mega_moe") == 2  # routed + shared, at prepare
    for _ in range(2):
        z = torch.randn(m, L, dtype=torch.bfloat16)
        ids, w = routing(m)
        x_s = torch.randn(m, H, dtype=torch.bfloat16)
        args = producer_args(z, ids, w, routed, x_s, shared, rms_weight, "local", None)
        assert sm100_mega_moe.supports(*args) is None
        y_n, ws = sm100_mega_moe.producer_deepgemm(*args)
        assert tuple(ws.shape) == (1, m, H) and ws.dtype == torch.bfloat16
        assert rel_l2(y_n, expected_y(z, ids, w, routed, rms_weight)) < 5e-3
        assert rel_l2(ws[0], shared_expert_math(x_s, *shared, BETA, LIN_BETA)) < 1e-6
    # buffer and weights are built once; forward only stages inputs and launches
    assert fake.count("get_symm_buffer_for_mega_moe") == 1
    assert fake.count("transform_weights_for_mega_moe") == 2
    assert fake.count("fp8_fp4_mega_moe_bf16_shared") == 2
    routed[0].add_(0)  # an in-place update bumps the version: the routed weights are converted again
    sm100_mega_moe.producer_deepgemm(*producer_args(z, ids, w, routed, x_s, shared, rms_weight, "local", None))
    assert fake.count("transform_weights_for_mega_moe") == 3


def test_supports_reasons(fake, monkeypatch):
    routed, shared = routed_weights_(), shared_weights_()
    rms_weight = torch.ones(L, dtype=torch.bfloat16)
    z, (ids, w), x_s = torch.randn(3, L, dtype=torch.bfloat16), routing(3), torch.randn(3, H, dtype=torch.bfloat16)
    args = producer_args(z, ids, w, routed, x_s, shared, rms_weight, "local", None)
    assert "prepare_deepgemm_producer" in sm100_mega_moe.supports(*args)
    deepgemm.prepare_deepgemm_producer(mode="local", group_name=None, num_experts=E, max_tokens=2, top_k=K,
                                       latent=L, inter=INTER, hidden=H, shared_inter=I_S, device="cpu")
    assert "larger max_tokens" in sm100_mega_moe.supports(*args)
    monkeypatch.delenv(sm100_mega_moe.FP8_OPT_IN)
    assert "FP8" in sm100_mega_moe.supports(*args)
    monkeypatch.setenv(sm100_mega_moe.FP8_OPT_IN, "yes")  # a typo is refused, not read as "no"
    with pytest.raises(ValueError, match=f"{sm100_mega_moe.FP8_OPT_IN}='yes': expected 1"):
        sm100_mega_moe.supports(*args)
    monkeypatch.setenv(sm100_mega_moe.FP8_OPT_IN, "1")
    bf16_args = (z, ids, w, torch.zeros(E, 2 * INTER, L, dtype=torch.bfloat16),
                 torch.zeros(E, L, INTER, dtype=torch.bfloat16), None, None, "bf16") + args[8:]
    assert "mxfp4" in sm100_mega_moe.supports(*bf16_args)
    assert "agreed" in sm100_mega_moe.supports(*args[:-1], "some-group")
    assert "sm_100" in deepgemm.deepgemm_status() and "local@local" in deepgemm.deepgemm_status()


def test_no_preparation_or_conversion_inside_capture(fake, monkeypatch):
    monkeypatch.setattr(sm100_state, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="before CUDA-graph capture"):
        deepgemm.prepare_deepgemm_producer(mode="local", group_name=None, num_experts=E, max_tokens=4, top_k=K,
                                           latent=L, inter=INTER, hidden=H, shared_inter=I_S, device="cpu")
    monkeypatch.setattr(weights, "capturing", lambda: True)
    with pytest.raises(RuntimeError, match="warm-up call before capture"):
        sm100_mega_moe.routed_weights(*routed_weights_())


def test_unavailable_means_no_state(monkeypatch):
    install(monkeypatch, FakeDeepGemm(), (9, 0))  # MegaMoE needs sm_100
    state = deepgemm.prepare_deepgemm_producer(mode="local", group_name=None, num_experts=E, max_tokens=4,
                                               top_k=K, latent=L, inter=INTER, hidden=H, shared_inter=I_S,
                                               device="cpu")
    assert state is None and "sm_10x" in deepgemm.deepgemm_status()
    deepgemm.reset_deepgemm_state()


class _Group:
    group_name = "sim"

    def __init__(self, rank: int, world: int) -> None:
        self._rank, self._world = rank, world

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def barrier(self) -> None:
        return None


class _Symmetric:
    """R simulated ranks' symmetric workspaces in one process; peer pointers resolve via fake.memory."""

    def __init__(self, fake: FakeDeepGemm, world: int) -> None:
        self.fake, self.world, self.rank, self.tensors, self.barriers = fake, world, 0, None, 0

    def alloc(self, shape, dtype, device, group_name):
        if self.tensors is None:
            self.tensors = [torch.full(shape, float("nan"), dtype=dtype) for _ in range(self.world)]
            for t in self.tensors:
                self.fake.memory[t.data_ptr()] = t
        return self.tensors[self.rank], [t.data_ptr() for t in self.tensors], self

    def barrier(self, channel: int = 0) -> None:
        self.barriers += 1


@pytest.mark.parametrize("mode", ["hidden_scatter", "token_publish"])
def test_two_ranks_publish_into_our_layouts(fake, monkeypatch, mode):
    world, m = 2, 4
    sym = _Symmetric(fake, world)
    monkeypatch.setattr(sm100_state, "_group_info", lambda name: (_Group(sym.rank, world), world, sym.rank))
    agreed = probe_deepgemm()
    monkeypatch.setattr(sm100_state, "_agree", lambda group: agree._AGREED.setdefault("sim", agreed))
    states = []
    for q in range(world):
        sym.rank = q
        states.append(deepgemm.prepare_deepgemm_producer(
            mode=mode, group_name="sim", num_experts=E, max_tokens=m, top_k=K, latent=L, inter=INTER, hidden=H,
            shared_inter=I_S, device="cpu", allocator=sym.alloc,
        ))
    routed = [routed_weights_() for _ in range(world)]
    shared = [shared_weights_() for _ in range(world)]  # each rank's TP shard of the shared expert
    rms_weight = (1 + 0.1 * torch.randn(L)).to(torch.bfloat16)
    for step in range(2):  # the second call lands in the next generation of the workspace
        m_s = world * m if mode == "token_publish" else m
        x_s = torch.randn(m_s, H, dtype=torch.bfloat16)  # gathered (SP) or replicated (TP) tokens
        inputs = [(torch.randn(m, L, dtype=torch.bfloat16), *routing(m)) for _ in range(world)]
        args = [producer_args(*inputs[q], routed[q], x_s, shared[q], rms_weight, mode, "sim") for q in range(world)]
        assert sm100_mega_moe.supports(*args[0]) is None
        launched = [sm100_mega_moe.launch(states[q], args[q]) for q in range(world)]  # every rank launches,
        out = [sm100_mega_moe.collect(states[q], launched[q]) for q in range(world)]  # then reads its fragments
        s = [shared_expert_math(x_s, *shared[r], BETA, LIN_BETA) for r in range(world)]
        cols = H // world
        for q in range(world):
            y_n, ws = out[q]
            assert rel_l2(y_n, expected_y(*inputs[q], routed[q], rms_weight)) < 5e-3
            if mode == "hidden_scatter":
                want = torch.stack([s[r][:, q * cols:(q + 1) * cols] for r in range(world)])  # [R, M, H/R]
            else:
                want = torch.stack([s[r][q * m:(q + 1) * m] for r in range(world)], dim=1)  # [M, R, H]
            assert ws.shape == want.shape and ws.is_contiguous() and torch.equal(ws, want)
            assert int(states[q].publish.flags[0]) == (step + 1) % 3
    assert sym.barriers == 2 * world
    assert fake.count("fp8_fp4_mega_moe_bf16_shared_rs" if mode == "hidden_scatter"
                      else "fp8_fp4_mega_moe_bf16_shared_sp_rs") == 2 * world
