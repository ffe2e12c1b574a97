"""One check for a bad argument: the op and its fake impl (what torch.compile traces) both refuse it."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops import LmfInputError


def assert_refused(op, op_name: str, args: dict, message: str) -> None:
    """op(*args.values()) raises LmfInputError naming lmf::<op_name> with `message` (a regex), and so
    does the op on fake tensors."""
    with pytest.raises(LmfInputError, match=f"lmf::{op_name}: {message}"):
        op(*args.values())
    with pytest.raises(LmfInputError, match=message):
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            op(*[mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for v in args.values()])
