"""Positive pattern tests: every form x variant is rewritten, once per block.

Each model holds one stack of 2 blocks per variant (merged/split gate-up x F.rms_norm/manual RMSNorm,
alternating bf16/MXFP4 expert weights) side by side in one graph, so one trace covers all variants of
a form and dtype; the report must show 2 rewritten blocks per variant and nothing rejected. TP and
SP trace on a single-process fake group (the rewrite is checked here; numerics run on gloo).
"""

from collections import Counter

import pytest
import torch

import latent_moe_fusion as lmf
from tests.fusion_models import (
    ALL_GATHER,
    CFG,
    ROUTE_GATHER_AND_PRODUCE,
    TAIL,
    VARIANTS,
    fake_group,
    post_grad,
    producers,
    variant_stacks,
)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
FORMS = {"local": None, "all_reduce": False, "sequence_parallel": True}  # form -> sequence_parallel


def _check_all_variants_fused(report, form: str, dtype: str) -> None:
    assert report.rejected == [], report.summary()
    assert report.matched == 2 * len(VARIANTS), report.summary()
    assert {b.form for b in report.blocks} == {form}
    seen = Counter()
    for b in report.blocks:
        seen[tuple(part.split("=")[1] for part in b.variant.split("; ")[0].split(", ") if "=" in part)] += 1
        assert dtype in b.variant
    assert seen == Counter({(gate_up, norm, fmt): 2 for gate_up, norm, fmt in VARIANTS}), seen
    assert producers(report.ops_after) == report.ops_after[TAIL] == 2 * len(VARIANTS)
    assert report.ops_after["lmf.routed_experts.default"] == 0
    for collective in ("_c10d_functional.all_reduce.default", "_c10d_functional.reduce_scatter_tensor.default"):
        assert report.ops_after[collective] == 0, report.summary()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", FORMS)
def test_every_variant_of_a_form_is_fused_once_per_block(form, dtype):
    world = 1 if form == "local" else 2
    x = torch.randn(8, CFG.hidden_size, dtype=DTYPES[dtype])
    if form == "local":
        fusion_pass = lmf.LatentMoEFusionPass()
        post_grad(variant_stacks(DTYPES[dtype]), (x,), fusion_pass)
    else:
        with fake_group(world) as group:
            model = variant_stacks(DTYPES[dtype], tp_group=group, sequence_parallel=FORMS[form])
            fusion_pass = lmf.LatentMoEFusionPass()
            post_grad(model, (x,), fusion_pass)
    _check_all_variants_fused(fusion_pass.report, form, dtype)
    if form == "sequence_parallel":  # each block's input all_gather goes into the op that reads it
        assert fusion_pass.report.ops_after[ALL_GATHER] == 0
        assert fusion_pass.report.ops_after[ROUTE_GATHER_AND_PRODUCE] == 2 * len(VARIANTS)
        assert all(r.gathers_tokens for r in fusion_pass.report.routings), fusion_pass.report.summary()
