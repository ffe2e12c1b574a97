"""The PDL variants (ops/common/pdl.py) compile for sm_90 on this CPU machine, and in their PTX nothing that a
predecessor writes is read, and nothing is written, before griddepcontrol.wait: only the weight
prefetch (and, in L2, the grouping's block table, written before L1 started) comes first; producers
signal before their first load. Runs tests/pdl_compile_sm90.py without TRITON_INTERPRET."""

import json
from pathlib import Path

import pytest

from tests.compiled_python import run_compiled

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def where() -> dict:
    done = run_compiled([str(ROOT / "tests" / "pdl_compile_sm90.py")], timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tail_prefetches_weights_then_waits_before_any_access(where):
    t = where["tail_swap_kernel"]
    assert 0 <= t["prefetch"] < t["wait"] < t["load"], t
    assert t["wait"] < t["store"], t
    tma = where["tail_swap_tma_kernel"]
    assert 0 <= tma["wait"] < tma["tensor_copy"] and tma["wait"] < tma["load"], tma


def test_gemv_tail_reads_only_weights_before_its_wait(where):
    g = where["tail_gemv_kernel"]
    # The preload: 1024 columns x 8 rows over 128 threads = 8 sixteen-byte loads per thread, every one
    # addressed from w_ptr alone; A and the fragments (written by the predecessor) only after the wait.
    pointers = {"a_ptr", "w_ptr", "f_ptr", "out_ptr"}
    assert [sorted(pointers.intersection(load)) for load in g["before_wait"]] == [["w_ptr"]] * 8, g["before_wait"]
    assert 0 <= g["wait"] < g["store"], g


def test_producers_signal_before_their_loads(where):
    for name in ("combine_kernel", "l1_regs_kernel"):
        k = where[name]
        assert 0 <= k["signal"] < k["load"], (name, k)
        assert k["wait"] == -1, (name, k)  # launched plainly: nothing to wait for


def test_dependent_finish_and_l2_wait_before_reading_l1s_output(where):
    fin = where["l1_finish_kernel"]
    assert 0 <= fin["signal"] < fin["wait"] < fin["load"], fin
    l2 = where["l2_regs_kernel"]
    # before the wait: only the block table's scalar load and the weight prefetch
    assert 0 <= l2["prefetch"] < l2["wait"] < l2["load_v4"], l2
    assert l2["wait"] < l2["store"], l2
