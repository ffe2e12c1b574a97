"""Search/replacement pairs of the fusion pass: one module per form, variants built by PatternSpec.

Forms (how this rank's partial shared-expert output reaches the final add):
  local.py              R = 1, added as is                       -> fused layout `local`
  all_reduce.py         TP, all_reduce + wait_tensor             -> `hidden_scatter`
  sequence_parallel.py  SP, reduce_scatter_tensor + wait_tensor  -> `token_publish`
Variants (spec.py): merged or split shared gate/up, F.rms_norm or manual float32 RMSNorm, dtype
(bfloat16, float32), expert weight format (bf16, mxfp4), and for collectives the process group.
"""

from __future__ import annotations

import torch

from . import all_reduce, local, sequence_parallel
from .spec import GATE_UP_FORMS, NORM_FORMS, WEIGHT_FORMATS, Form, PatternSpec

FORMS: dict[str, Form] = {m.FORM.name: m.FORM for m in (local, all_reduce, sequence_parallel)}
DTYPES = (torch.bfloat16, torch.float32)

__all__ = ["DTYPES", "FORMS", "GATE_UP_FORMS", "NORM_FORMS", "WEIGHT_FORMATS", "Form", "PatternSpec"]
