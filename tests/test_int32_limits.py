"""Prefill sizes against the kernels' int32 limits, on meta tensors (nothing large is allocated): one EP8 rank of
Kimi K3 (H = 7168, L = 3584, 112 MXFP4 experts of I = 3072, top-16, shared I_s = 768).

At M = 32768 no tensor of the fused block reaches past int32 element offsets (the largest, the routed FP32 pair rows
[524288, 3584], stops at 88 % of it), yet the Triton tail refused it for a split-K workspace of 16 copies of the
output that the launcher never allocates at that M: the pass left the block unfused. At M = 65536 the pair rows and
the activation rows do pass int32; the kernels then take int64 offsets (ops/common/element_offsets.py). What is
still refused says which tensor and which limit.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from latent_moe_fusion.fusion_pass.capabilities import Capabilities
from latent_moe_fusion.fusion_pass.checks import serving_backend
from latent_moe_fusion.fusion_pass.config import FusionConfig
from latent_moe_fusion.fusion_pass.reject import Reject
from latent_moe_fusion.ops.common.element_offsets import INT32_MAX, last_offset, needs_int64_offsets
from latent_moe_fusion.ops.common.fragment_layouts import fragment_shape
from latent_moe_fusion.ops.common.tail_gemm import tail_launch
from latent_moe_fusion.ops.routed import expert_triton_backend, producer_triton_backend
from latent_moe_fusion.ops.routed.triton.moe_align import max_blocks
from latent_moe_fusion.ops.tail.cute import tail_backend as cute_tail
from latent_moe_fusion.ops.tail.triton import triton_tail_backend

H, L, INTER, INTER_S, EXPERTS, TOP_K = 7168, 3584, 3072, 768, 112, 16
BF16 = torch.bfloat16
PREFILL = (16384, 32768, 65536)


def _meta(*shape, dtype=BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _tail_args(m: int, mode: str = "local", world: int = 1) -> tuple:
    """latent_tail's arguments as the pass builds them (fusion_pass/checks.py), for one rank of `world`."""
    return _meta(m, L), _meta(H, L), _meta(*fragment_shape(mode, m, H, world)), mode, None


def _routed_args(m: int) -> tuple:
    u8 = torch.uint8
    return (_meta(m, L), _meta(m, TOP_K, dtype=torch.int32), _meta(m, TOP_K, dtype=torch.float32),
            _meta(EXPERTS, 2 * INTER, L // 2, dtype=u8), _meta(EXPERTS, L, INTER // 2, dtype=u8),
            _meta(EXPERTS, 2 * INTER, L // 32, dtype=u8), _meta(EXPERTS, L, INTER // 32, dtype=u8), "mxfp4", 4.0, 25.0)


def _producer_args(m: int) -> tuple:
    return _routed_args(m) + (_meta(L), 1e-5, _meta(m, H), _meta(INTER_S, H), _meta(INTER_S, H), _meta(H, INTER_S), "local", None)


def test_last_offset_follows_strides():
    assert last_offset((3, 4), (4, 1)) == 11
    assert last_offset((4, 3), (1, 4)) == 11  # a transposed view reaches as far
    assert last_offset((3, 4), (10, 1)) == 23  # rows of a wider tensor: the gaps count
    assert last_offset((0, 4), (4, 1)) == 0
    assert last_offset((2, 1, 5), (5, 10**12, 1)) == 9  # a size-1 dimension's stride is never stepped


@pytest.mark.parametrize("m", PREFILL)
def test_which_block_tensors_pass_int32(m):
    """Exactly the routed FP32 pair rows, the activation rows and the kappa kernels' gathered z rows pass int32
    offsets, from M = 65536 on (not at 32768; the gathered rows first, from M ~ 36560 counting every pair local)."""
    pairs = m * TOP_K
    rows = max_blocks(pairs, EXPERTS, 128) * 128  # the 128-row blocks at prefill
    tensors = {"pair rows": _meta(pairs, L, dtype=torch.float32), "act": _meta(rows, INTER), "x_s": _meta(m, H),
               "z": _meta(m, L), "z rows": _meta(rows, L), "ws": _meta(1, m, H), "out": _meta(m, H)}
    past = sorted(name for name, t in tensors.items() if needs_int64_offsets(t))
    assert past == ([] if m <= 32768 else ["act", "pair rows", "z rows"]), (m, past)
    assert not needs_int64_offsets(*tensors.values()) or m == 65536


@pytest.mark.parametrize("m", PREFILL)
@pytest.mark.parametrize("mode, world", [("local", 1), ("hidden_scatter", 1), ("token_publish", 1)])
def test_triton_tail_takes_prefill(m, mode, world):
    assert triton_tail_backend.supports(*_tail_args(m, mode, world)) is None


def test_triton_tail_takes_fragments_past_int32():
    # Sequence parallel over 8 ranks, 65536 output tokens per rank: ws [M, 8, H] reaches 3.8e9 elements, which the
    # kernels address in int64.
    y, w, ws = _meta(65536, L), _meta(H, L), _meta(65536, 8, H)
    assert needs_int64_offsets(ws.transpose(0, 1))
    assert triton_tail_backend.supports(y, w, ws, "token_publish") is None


def test_triton_tail_plans_no_split_at_prefill():
    """The launch at M = 32768 (what supports() now asks) runs the tiled kernel: no split-K workspace."""
    plan = tail_launch.plan_launch(32768, H, L, False, 132)
    assert plan.config.kernel.startswith("tile") and plan.split_k == 1 and plan.reason is None
    decode = tail_launch.plan_launch(16, 896, L, False, 132)  # a narrow hidden_scatter slice: split-K
    assert decode.split_k > 1 and decode.reason is None


def test_triton_tail_refuses_what_the_launcher_cannot_run():
    # Split-K at M = 16 over an N so wide that its tiles outnumber the arrival counters.
    y, w, ws = _meta(16, L), _meta(64 * 8193, L), _meta(1, 16, 64 * 8193)
    reason = triton_tail_backend.supports(y, w, ws, "local")
    assert reason is not None and "8193 N tiles exceeds its 8192 counters" in reason, reason
    assert "float16" in triton_tail_backend.supports(_meta(4, L, dtype=torch.float16), w, ws, "local")


def test_triton_tail_support_guards_nothing_on_a_symbolic_m():
    """A graph compiled for any batch: the answer holds for every bucket, and no guard on M is installed."""
    shape_env = ShapeEnv()
    source = ConstantSource("m")
    m = shape_env.create_symintnode(shape_env.create_symbol(64, source, dynamic_dim=DimDynamic.DYNAMIC), hint=64,
                                    source=source)
    with FakeTensorMode(shape_env=shape_env):
        y = torch.empty(m, L, dtype=BF16)
        ws = torch.empty(1, m, H, dtype=BF16)
        assert triton_tail_backend.supports(y, torch.empty(H, L, dtype=BF16), ws, "local") is None
        wide = torch.empty(64 * 8193, L, dtype=BF16)
        reason = triton_tail_backend.supports(y, wide, torch.empty(1, m, 64 * 8193, dtype=BF16), "local")
        assert reason is not None and "counters" in reason
    assert not shape_env.guards, shape_env.guards


def test_cute_tail_names_the_tensor_past_int32():
    assert cute_tail.shape_reason(_meta(32768, L), _meta(H, L), _meta(1, 32768, H)) is None
    ws = _meta(65536, 8, H).transpose(0, 1)  # token_publish over 8 ranks, as [R, M, N]
    reason = cute_tail.shape_reason(_meta(65536, L), _meta(H, L), ws)
    assert reason is not None and reason.startswith("ws as [R, M, N] (8, 65536, 7168) reaches 3758096383 elements")
    assert f"at most {INT32_MAX}" in reason and "the Triton tail takes it" in reason


@pytest.mark.parametrize("m", PREFILL)
def test_producer_takes_prefill(m):
    assert expert_triton_backend._supports(*_routed_args(m)) is None
    assert producer_triton_backend._supports(*_producer_args(m)) is None


def test_producer_refuses_pair_indices_past_int32():
    m = 2**31 // TOP_K  # the grouping's row indices (pairs and each expert's padding) pass int32
    reason = expert_triton_backend._supports(*_routed_args(m))
    assert reason is not None and "grouping's int32 indices" in reason and str(m * TOP_K) in reason, reason


CUDA_BACKENDS = Capabilities(False, frozenset({("latent_tail", "cute"), ("latent_tail", "triton"),
                                               ("moe_shared_producer", "triton")}), 1)


@pytest.mark.parametrize("m", PREFILL)
def test_pass_finds_backends_for_the_block_at_prefill(m):
    """The pass's backend check (fusion_pass/checks.py), as on an H200 where both tails are installed: the block at
    M = 32768 (and 65536) is served by the Triton tail and producer, so no shape reason leaves it unfused."""
    config = FusionConfig()
    assert serving_backend("latent_tail", "cuda", _tail_args(m), config, CUDA_BACKENDS) == "triton"
    assert serving_backend("moe_shared_producer", "cuda", _producer_args(m), config, CUDA_BACKENDS) == "triton"


def test_pass_rejection_names_the_limit():
    with pytest.raises(Reject, match="grouping's int32 indices"):
        serving_backend("moe_shared_producer", "cuda", _producer_args(2**31 // TOP_K), FusionConfig(), CUDA_BACKENDS)
