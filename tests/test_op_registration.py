"""How the lmf ops are registered: schema tags, kernels per dispatch key, and no autograd."""

from __future__ import annotations

import pytest
import torch

from tests.op_inputs import producer_args, routed_args, tail_args

OPS = ("routed_experts", "moe_shared_producer", "latent_tail")


@pytest.mark.parametrize("name", OPS)
def test_op_has_cpu_cuda_kernels_and_is_pt2_compliant(name):
    qualified = f"lmf::{name}"
    for key in ("CPU", "CUDA"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, key), f"{qualified} has no {key} kernel"
    assert torch.Tag.pt2_compliant_tag in getattr(torch.ops.lmf, name).default.tags


@pytest.mark.parametrize("name, make_args", [
    ("routed_experts", lambda gen: routed_args(3, torch.float32, "bf16", gen)),
    ("moe_shared_producer", lambda gen: producer_args(3, torch.float32, "bf16", gen)),
    ("latent_tail", lambda gen: tail_args(3, torch.float32, gen)),
])
def test_ops_are_not_differentiable_and_say_so_on_backward(name, make_args, rng_seed):
    """Autograd passes over the ops: outputs never require grad, so a backward through them fails
    instead of silently leaving the inputs without gradients."""
    args = make_args(torch.Generator().manual_seed(rng_seed))
    first = next(iter(args))  # the activation (z or y_n)
    args[first] = args[first].clone().requires_grad_(True)
    out = getattr(torch.ops.lmf, name)(**args)
    outs = out if isinstance(out, tuple) else (out,)
    assert not any(o.requires_grad for o in outs)
    with pytest.raises(RuntimeError, match="does not require grad"):
        outs[0].float().sum().backward()
