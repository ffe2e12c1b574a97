"""One gloo run per world size, shared by every test that needs R real ranks.

Starting a worker process (import torch and the package) costs ~10 s of CPU on 2 cores, so workers
fork from a forkserver that imported the package once, and the multi-rank checks of several test
files run as parts of one run per world size. The first test that asks for a world size starts
the run; later ones read its cached report.
A part is `module:function` called as function(rank, world, seed) on every rank, in the same
order on every rank (their collectives must pair up); a part that raises is reported as failed
without stopping the other parts.
"""

from __future__ import annotations

import functools
import importlib
import os
import traceback
from typing import Any

from tests.gloo import run_gloo

# Imported once by the forkserver the workers start from (see tests/gloo.py).
PRELOAD = ("latent_moe_fusion", "tests.op_inputs", "tests.float64_reference")

PARTS: dict[int, tuple[str, ...]] = {
    2: (
        "tests.test_opcheck:opcheck_layouts_on_ranks",
        "tests.test_bad_inputs:group_errors_on_ranks",
        "tests.test_identity:identity_on_ranks",
        "tests.test_block:expert_shares_on_ranks",
        "tests.test_route_gather_and_produce:gather_op_on_ranks",
    ),
    4: ("tests.test_identity:identity_on_ranks", "tests.test_route_gather_and_produce:gather_op_on_ranks"),
}


def _run_parts(rank: int, world: int, seed: int, parts: tuple[str, ...]) -> dict[str, tuple[str, Any]]:
    report = {}
    for part in parts:
        module, function = part.split(":")
        try:
            report[part] = ("ok", getattr(importlib.import_module(module), function)(rank, world, seed))
        except Exception:  # the test that owns the part fails with this traceback
            report[part] = ("error", traceback.format_exc())
    return report


@functools.cache
def _report(world: int) -> tuple[int, list[dict]]:
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, run_gloo(_run_parts, world, (seed, PARTS[world]), timeout=600, preload=PRELOAD)


def results(world: int, part: str) -> tuple[int, list[Any]]:
    """(seed, [what `part` returned on rank r for r in range(world)]); raises if it failed on any rank."""
    seed, per_rank = _report(world)
    for rank, report in enumerate(per_rank):
        status, payload = report[part]
        if status != "ok":
            raise AssertionError(f"{part} failed on rank {rank} of {world} (seed {seed}):\n{payload}")
    return seed, [report[part][1] for report in per_rank]
