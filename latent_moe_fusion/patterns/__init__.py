"""Search/replacement pairs of the fusion pass: one module per form, variants built by PatternSpec."""

from __future__ import annotations

import torch

from . import all_reduce, local, sequence_parallel
from .spec import GATE_UP_FORMS, NORM_FORMS, WEIGHT_FORMATS, Form, PatternSpec

FORMS: dict[str, Form] = {m.FORM.name: m.FORM for m in (local, all_reduce, sequence_parallel)}
DTYPES = (torch.bfloat16, torch.float32)


def specs_for(
    form: str,
    dtype: torch.dtype,
    weight_format: str,
    group_name: str | None,
    world: int,
    gate_up_forms: tuple[str, ...] = GATE_UP_FORMS,
    norm_forms: tuple[str, ...] = NORM_FORMS,
) -> list[PatternSpec]:
    """Every variant of one form for one dtype, weight format and process group."""
    return [
        PatternSpec(FORMS[form], gate_up, norm, dtype, weight_format, group_name, world)
        for gate_up in gate_up_forms
        for norm in norm_forms
    ]


__all__ = ["DTYPES", "FORMS", "GATE_UP_FORMS", "NORM_FORMS", "WEIGHT_FORMATS", "Form", "PatternSpec", "specs_for"]
