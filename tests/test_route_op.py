"""lmf::noaux_tc_route on the CPU: its definition against a brute-force one, ties / NaN / signed zero,
the Triton kernel (interpreted) against the reference, opcheck and bad arguments."""

import math
import os

import pytest
import torch

from latent_moe_fusion.ops.common.route_math import ordered_keys, route_reference, topk_ids_cuda_order
from latent_moe_fusion.ops.router.triton.route_topk import noaux_tc_route_triton, route_launch_shape
from tests.bad_arguments import assert_refused

ROUTE = torch.ops.lmf.noaux_tc_route


def brute_force(logits, bias, top_k, eps, scale, first, num_local):
    """Row by row in Python: the selection and order ops/router/noaux_tc_route.py defines, weights in float64."""
    scores = torch.sigmoid(logits)
    biased = scores + bias
    keys = ordered_keys(biased)
    ids, weights = [], []
    for row in range(logits.shape[0]):
        k = keys[row].tolist()
        ranked = sorted(range(len(k)), key=lambda i: (-k[i], i))[:top_k]
        kth = k[ranked[-1]]
        chosen = sorted(i for i in ranked if k[i] > kth) + sorted(i for i in ranked if k[i] == kth)
        s = [float(scores[row, i]) for i in chosen]
        total = math.fsum(s) + eps
        weights.append([v / total * scale for v in s])
        ids.append([i - first if 0 <= i - first < num_local else -1 for i in chosen])
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(weights, dtype=torch.float64)


def _on_kernel_device(*tensors):
    """The Triton kernel's tensors: on the GPU where there is one, else on the CPU for the interpreter."""
    return tuple(t.cuda() for t in tensors) if torch.cuda.is_available() else tensors


def _inputs(m, e, gen, spread=3.0):
    return torch.randn(m, e, generator=gen) * spread, torch.randn(e, generator=gen) * 0.1


@pytest.mark.parametrize("m, e, k, first, num_local", [(1, 896, 16, 0, 896), (6, 896, 16, 112, 112), (9, 40, 7, 5, 30)])
def test_reference_matches_brute_force(rng_seed, m, e, k, first, num_local):
    gen = torch.Generator().manual_seed(rng_seed)
    logits, bias = _inputs(m, e, gen)
    ids, weights = ROUTE(logits, bias, k, 1e-20, 2.5, first, num_local)
    want_ids, want_weights = brute_force(logits, bias, k, 1e-20, 2.5, first, num_local)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    assert (weights.double() - want_weights).abs().max() <= 4e-7 * 2.5


def test_ties_go_to_the_lower_index_and_come_after_the_larger_scores():
    # sigmoid(40) == 1.0 exactly: every expert ties except where the bias lifts it
    logits = torch.full((2, 12), 40.0)
    bias = torch.zeros(12)
    bias[[9, 4]] = 0.5
    ids, weights = ROUTE(logits, bias, 5, 0.0, 1.0, 0, 12)
    assert ids.tolist() == [[4, 9, 0, 1, 2]] * 2  # above the k-th value by index, then the tied ones
    assert torch.equal(weights, torch.full((2, 5), 0.2))


def test_nan_is_largest_and_negative_zero_below_positive_zero():
    keys = ordered_keys(torch.tensor([1.0, float("nan"), -0.0, 0.0, -1.0, float("inf")]))
    order = torch.argsort(keys, descending=True).tolist()
    assert order == [1, 5, 0, 3, 2, 4]
    values = torch.tensor([[0.0, -0.0, 0.0, -0.0]])
    assert topk_ids_cuda_order(values, 3).tolist() == [[0, 2, 1]]  # +0 twice (above), then the first -0


@pytest.mark.parametrize("m, e, k, first, num_local", [
    (1, 896, 16, 0, 896),  # Kimi K3 decode
    (5, 896, 16, 112, 112),  # one EP8 rank's share
    (3, 40, 7, 0, 40),  # E not a power of two, odd k
    (9, 64, 8, 3, 20),
])
def test_triton_kernel_matches_reference(rng_seed, m, e, k, first, num_local):
    assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
    gen = torch.Generator().manual_seed(rng_seed)
    logits, bias = _inputs(m, e, gen)
    ids, weights = noaux_tc_route_triton(*_on_kernel_device(logits, bias), k, 1e-20, 1.5, first, num_local)
    want_ids, want_weights = route_reference(logits, bias, k, 1e-20, 1.5, first, num_local)
    ids, weights = ids.cpu(), weights.cpu()
    assert torch.equal(ids, want_ids)
    rel = (weights - want_weights).norm() / want_weights.norm()
    assert rel <= 1e-6, rel


def test_triton_kernel_ties_and_rows_over_one_program(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    logits = torch.where(torch.rand(37, 48, generator=gen) < 0.5, 40.0, torch.randn(37, 48, generator=gen))
    bias = (torch.randint(0, 3, (48,), generator=gen) * 0.25).float()  # few distinct values: many exact ties
    assert route_launch_shape(37, 48)[0] == 64
    ids, weights = noaux_tc_route_triton(*_on_kernel_device(logits, bias), 6, 0.0, 1.0, 0, 48,
                                         launch=(4, 2))  # ragged last program
    want_ids, want_weights = route_reference(logits, bias, 6, 0.0, 1.0, 0, 48)
    ids, weights = ids.cpu(), weights.cpu()
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=0)


def test_triton_kernel_top_1(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    logits, bias = _inputs(5, 40, gen)
    ids, weights = noaux_tc_route_triton(*_on_kernel_device(logits, bias), 1, 1e-20, 1.0, 0, 40)
    want_ids, want_weights = route_reference(logits, bias, 1, 1e-20, 1.0, 0, 40)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, rtol=1e-6, atol=0)


def test_empty_batch():
    ids, weights = ROUTE(torch.empty(0, 16), torch.zeros(16), 4, 1e-20, 1.0, 0, 16)
    assert ids.shape == (0, 4) and weights.shape == (0, 4)


def test_opcheck(rng_seed):
    gen = torch.Generator().manual_seed(rng_seed)
    logits, bias = _inputs(7, 64, gen)
    result = torch.library.opcheck(ROUTE, (logits, bias, 8, 1e-20, 1.0, 16, 16))
    assert result and all(v == "SUCCESS" for v in result.values()), result


def _good():
    return dict(logits=torch.randn(4, 32), correction_bias=torch.randn(32), top_k=4, renorm_eps=1e-20,
                scaling_factor=1.0, first_expert=0, num_local=32)


BAD = [
    ("logits", dict(logits=torch.randn(4, 32).bfloat16()), "logits must have dtype float32"),
    ("logits", dict(logits=torch.randn(2, 4, 32)), "logits must be 2-D"),
    ("logits", dict(logits=torch.randn(32, 4).t()), "logits must be contiguous"),
    ("correction_bias", dict(correction_bias=torch.randn(31)), "correction_bias has 31 entries"),
    ("correction_bias", dict(correction_bias=torch.randn(32).double()), "correction_bias must have dtype float32"),
    ("top_k", dict(top_k=0), r"top_k must be an int in \[1, E = 32\]"),
    ("top_k", dict(top_k=33), r"top_k must be an int in \[1, E = 32\]"),
    ("renorm_eps", dict(renorm_eps=-1.0), "renorm_eps must be a finite number >= 0"),
    ("scaling_factor", dict(scaling_factor=float("inf")), "scaling_factor must be a finite number"),
    ("first_expert", dict(first_expert=32), r"first_expert must be an int in \[0, E = 32\)"),
    ("num_local", dict(num_local=17, first_expert=16), r"num_local must be an int in \[1, E - first_expert = 16\]"),
    ("num_local", dict(num_local=0), r"num_local must be an int in \[1"),
]


@pytest.mark.parametrize("name, change, message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_name_the_argument(name, change, message):
    assert_refused(ROUTE, "noaux_tc_route", _good() | change, message)
