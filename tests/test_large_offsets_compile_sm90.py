"""The kernels that take LARGE_OFFSETS (ops/common/element_offsets.py) compile for sm_90 on this CPU machine both
ways: the int64 build adds its pointer offsets in 64 bits, the int32 build (every decode launch) in as few as without
the flag, none at all in the tail kernels. Runs tests/large_offsets_compile_sm90.py without TRITON_INTERPRET."""

import json
from pathlib import Path

import pytest

from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent
TAIL_KERNELS = ("tail_gemv_kernel", "tail_swap_kernel", "tail_swap_tma_kernel", "tail_tile_kernel",
                "tail_tile_tma_kernel")
PRODUCER_KERNELS = ("l1_kernel", "l2_kernel")


@pytest.fixture(scope="module")
def built() -> dict:
    done = run_compiled([str(ROOT / "tests" / "large_offsets_compile_sm90.py")], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", TAIL_KERNELS + PRODUCER_KERNELS)
def test_both_builds_compile(built, kernel):
    for large in (False, True):
        assert built[f"{kernel} large={large}"]["cubin_bytes"] > 0


@pytest.mark.parametrize("kernel", TAIL_KERNELS)
def test_tail_offsets_are_int32_unless_asked(built, kernel):
    small, large = (built[f"{kernel} large={flag}"]["wide_offsets"] for flag in (False, True))
    assert small == 0, f"{kernel}: the int32 build adds {small} offsets in 64 bits"
    assert large >= 2, f"{kernel}: the int64 build adds only {large} offsets in 64 bits (fragments and output at least)"


@pytest.mark.parametrize("kernel", PRODUCER_KERNELS)
def test_producer_grids_widen_their_row_offsets(built, kernel):
    # The int32 build already adds the expert's weight base and the FP32 pair rows in 64 bits; the flag widens the
    # activation rows too (and the shared expert's token rows).
    small, large = (built[f"{kernel} large={flag}"]["wide_offsets"] for flag in (False, True))
    assert large > small, (kernel, small, large)
