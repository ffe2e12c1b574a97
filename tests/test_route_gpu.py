"""lmf::noaux_tc_route on the GPU: the order helper against CUDA torch.topk (single- and multi-block
top-k), the Triton kernel against the reference and against the compiled unfused chain, bitwise ids."""

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.model.router import localize_ids, route_from_logits
from latent_moe_fusion.ops.common.route_math import route_reference, topk_ids_cuda_order
from latent_moe_fusion.ops.router.triton.route_topk import noaux_tc_route_triton

pytestmark = pytest.mark.gpu
E, K = 896, 16


@pytest.mark.parametrize("m", [1, 8, 128, 1000, 4096, 5000])  # torch switches to its multi-block top-k at large M
@pytest.mark.parametrize("ties", [False, True])
def test_order_helper_is_cuda_topk_order(rng_seed, m, ties):
    values = torch.randn(m, E, device="cuda")
    if ties:
        values = torch.round(values * 2) / 2  # a handful of distinct values: ties at the k-th in most rows
    want = torch.topk(values, K, dim=-1, sorted=False).indices
    assert torch.equal(topk_ids_cuda_order(values, K), want)


@pytest.mark.parametrize("m", [1, 8, 128, 4096])
def test_triton_matches_reference(rng_seed, m):
    logits = torch.randn(m, E, device="cuda") * 2
    bias = torch.randn(E, device="cuda") * 0.1
    ids, weights = noaux_tc_route_triton(logits, bias, K, 1e-20, 1.0, 0, E)  # global ids: every choice shows
    want_ids, want_weights = route_reference(logits, bias, K, 1e-20, 1.0, 0, E)
    # tl.sigmoid and torch.sigmoid may differ in the last bit: only a near-tie at the k-th may route apart
    same = (ids == want_ids).all(-1)
    assert same.float().mean() >= 0.999, same.float().mean()
    assert ((weights - want_weights)[same].norm() / want_weights[same].norm()) <= 1e-6
    local_ids, local_weights = noaux_tc_route_triton(logits, bias, K, 1e-20, 1.0, 112, 112)  # EP rank 1 of 8
    assert torch.equal(local_ids, torch.where((ids >= 112) & (ids < 224), ids - 112, -1))
    assert torch.equal(local_weights, weights)


def test_triton_exact_ties_on_gpu():
    logits = torch.full((300, E), 40.0, device="cuda")  # sigmoid == 1.0 exactly everywhere
    bias = torch.zeros(E, device="cuda")
    bias[torch.randperm(E, device="cuda")[:5]] = 0.5
    ids, weights = noaux_tc_route_triton(logits, bias, K, 0.0, 1.0, 0, E)
    assert torch.equal(ids.long(), torch.topk(logits.sigmoid() + bias, K, sorted=False).indices)
    assert torch.equal(weights, torch.full_like(weights, 1.0 / K))


def _chain(logits, bias):
    ids, weights = route_from_logits(logits, bias, K, 1.0)
    return localize_ids(ids, 112, 112), weights


@pytest.mark.parametrize("m", [1, 8, 128, 4096])
def test_fused_ids_equal_the_compiled_chain_bitwise(rng_seed, m):
    torch._dynamo.reset()
    logits = torch.randn(m, E, device="cuda") * 2
    bias = torch.randn(E, device="cuda") * 0.1
    fpass = lmf.LatentMoEFusionPass()
    with torch._inductor.config.patch(fx_graph_cache=False):
        ids, weights = torch.compile(_chain, options={"post_grad_custom_pre_pass": fpass})(logits, bias)
        want_ids, want_weights = torch.compile(_chain)(logits, bias)
    assert [r.backend for r in fpass.report.routings] == ["triton"], fpass.report.summary()
    assert torch.equal(ids, want_ids)
    assert (weights - want_weights).norm() / want_weights.norm() <= 1e-6
