"""Shared fixtures. Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1)."""

import contextlib
import os

import torch

if not torch.cuda.is_available():
    # Must be set before any Triton kernel module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import latent_moe_fusion  # noqa: E402,F401  (registers torch.ops.lmf.*)
from latent_moe_fusion import tuning  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng_seed(request) -> int:
    """A fresh seed per test run (logged so a failure can be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    print(f"seed={seed}")
    return seed


@pytest.fixture
def tuned():
    """tuned(field=value, ...): tuning overrides (latent_moe_fusion.tuning) for the rest of the test, each call on
    top of the last (None: back to the measured default); all undone at teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(tuning.overrides(**changes))


@pytest.fixture(autouse=True)
def fresh_routed_plans():
    """Each test plans its routed calls anew: a test may replace a rule the memoised plans were made with."""
    from latent_moe_fusion.ops.routed.routed_plan import clear_plans

    clear_plans()
    yield
    clear_plans()
