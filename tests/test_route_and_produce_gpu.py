"""lmf::route_and_produce on the GPU (Kimi K3 widths, MXFP4 experts): its outputs are bitwise those of
lmf::route_and_project then lmf::moe_shared_producer (with the shared expert first: of the two ops with the
producer's shared expert on cuBLAS too, which it picks itself beside the register-dequant kernels from 5 tokens
on), also captured in a CUDA graph with poisoned outputs; and a compiled Kimi K3 rank block through it gives
bitwise the output of one through the two ops."""

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion import tuning
from latent_moe_fusion.fusion_pass import FusionConfig
from latent_moe_fusion.ops.routed.router_fused.route_and_produce import (
    SHARED_FIRST_URGENT_CHOICES,
    shared_first_wanted,
)
from tests.graph_replay import replay_without_host_sync
from tests.op_inputs import shared_gate_up

pytestmark = pytest.mark.gpu

OP = torch.ops.lmf.route_and_produce


@pytest.fixture(scope="module")
def model():
    cfg = lmf.KimiK3MoEConfig().replace(num_experts=64, shared_intermediate_size=768)
    return lmf.KimiK3MoEBlock(cfg, weight_format="mxfp4", dtype=torch.bfloat16, device="cuda", seed=1,
                              router_gemm="bf16", ep_size=2, ep_rank=1)


def _args(block, x) -> tuple:
    cfg = block.cfg
    w1_s, w3_s = shared_gate_up(block)
    return (x, block.gate_weight, block.correction_bias, block.w_down, "bf16", cfg.top_k, 1e-20,
            cfg.routed_scaling_factor, block.first_expert, block.num_local_experts, block.w13, block.w2,
            block.w13_scale, block.w2_scale, "mxfp4", cfg.situ_beta, cfg.situ_linear_beta, block.norm_weight,
            cfg.rms_norm_eps, x, w1_s, w3_s, block.shared_w2, "local", None)


def _two_ops(args: tuple, shared_by_cublas: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two ops; shared_by_cublas: with the producer's shared expert forced onto cuBLAS, as the shared-first
    schedule runs it (beside the register-dequant kernels the producer picks that itself from 5 tokens on)."""
    placement = dict(regs_shared="cublas", grid_shared="cublas") if shared_by_cublas else {}
    with tuning.overrides(shared_first_schedule=False, **placement):
        ids, weights, z = torch.ops.lmf.route_and_project(*args[:10])
        return torch.ops.lmf.moe_shared_producer(z, ids, weights, *args[10:])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("shared_first", [None, True, False])
@pytest.mark.parametrize("m", [1, 4, 5, 8, 37, 128, 200])
def test_outputs_are_those_of_the_two_ops(model, tuned, rng_seed, m, shared_first):
    tuned(shared_first_schedule=shared_first)
    x = torch.randn(m, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    args = _args(model, x)
    y_n, ws = OP(*args)
    want_y_n, want_ws = _two_ops(args, shared_by_cublas=shared_first_wanted(m))
    assert torch.equal(y_n, want_y_n) and torch.equal(ws, want_ws)
    out = torch.ops.lmf.latent_tail(y_n, model.w_up, ws, "local", None)
    assert _rel(out, model(x)) < 1.5e-2


@pytest.mark.parametrize("urgent", SHARED_FIRST_URGENT_CHOICES)
@pytest.mark.parametrize("m", [8, 64])
def test_urgent_branches_leave_the_outputs_bitwise(model, tuned, rng_seed, m, urgent):
    tuned(shared_first_urgent=urgent)
    x = torch.randn(m, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    args = _args(model, x)
    y_n, ws = OP(*args)
    want_y_n, want_ws = _two_ops(args, shared_by_cublas=True)
    assert torch.equal(y_n, want_y_n) and torch.equal(ws, want_ws)


@pytest.mark.parametrize("urgent", SHARED_FIRST_URGENT_CHOICES)
@pytest.mark.parametrize("m", [8, 64])
def test_captured_shared_first_replays_match(model, tuned, rng_seed, m, urgent):
    tuned(shared_first_schedule=None)
    tuned(shared_first_urgent=urgent)
    static_x = torch.randn(m, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    args = _args(model, static_x)
    for _ in range(2):
        OP(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = OP(*args)
    for out in static_out:
        out.fill_(float("nan"))  # poison: every element must be rewritten by the replay
    for _ in range(20):
        static_x.copy_(torch.randn_like(static_x))
        replay_without_host_sync(graph)
        for a, b in zip(static_out, _two_ops(args, shared_by_cublas=True), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("m", [1, 8, 32])
def test_compiled_block_is_bitwise_the_one_through_the_two_ops(model, rng_seed, m):
    x = torch.randn(m, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    outs, reports = [], []
    for config in (FusionConfig(), FusionConfig(shared_first=False)):
        fpass = lmf.LatentMoEFusionPass(config)
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):
            outs.append(torch.compile(model, options={"post_grad_custom_pre_pass": fpass}, dynamic=False)(x))
        reports.append(fpass.report)
    first, not_first = (r.routings[0] for r in reports)
    assert first.with_producer and "[shared_first]" in first.beside, reports[0].summary()
    assert not not_first.with_producer and "[side_stream]" in not_first.beside, reports[1].summary()
    assert reports[0].ops_after["lmf.route_and_produce.default"] == 1
    assert torch.equal(outs[0], outs[1])
