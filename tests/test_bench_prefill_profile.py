"""bench/prefill_profile.py reads Nsight Compute's raw page: each kernel's metrics in the table's units (durations in
us whatever unit ncu printed), its stall reasons summed into the cycles between a warp's issues, the wgmma pipe's
activity, and a clear refusal of a malformed case (the counters themselves need the H200)."""

import pytest

from bench import prefill_profile as pp

RAW = """==PROF== Connected to process 1
  l1_kappa_kernel (2688, 1, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    ---------------------------------------------------------------------- ----------- ------------
    dram__throughput.avg.pct_of_peak_sustained_elapsed                               %        13.49
    gpu__time_duration.sum                                                          ms         2.81
    launch__registers_per_thread                                       register/thread          128
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active           %        57.85
    sm__pipe_tensor_op_imma_cycles_active.avg.pct_of_peak_sustained_active           %            0
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio              inst         2.56
    smsp__average_warps_issue_stalled_selected_per_issue_active.ratio             inst            1
    smsp__average_warps_issue_stalled_wait_per_issue_active.ratio                 inst         1.08
    smsp__issue_active.avg.pct_of_peak_sustained_active                              %        44.54
    smsp__warps_active.avg.per_cycle_active                                       warp         3.95
  gather_kappa_rows_kernel (96, 1, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    gpu__time_duration.sum                                                          us       311.60
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio      inst        13.15
"""


def test_the_raw_page_becomes_one_row_per_kernel():
    l1, gather = pp.summarize("16384:kappa", RAW)
    assert (l1["M"], l1["variant"], l1["kernel"], l1["threads"]) == (16384, "kappa", "l1_kappa_kernel", 256)
    assert l1["ncu_us"] == pytest.approx(2810.0) and gather["ncu_us"] == pytest.approx(311.6)  # ms and us alike
    assert l1["registers"] == 128 and l1["issue_pct"] == 44.54 and l1["active_warps"] == 3.95
    assert l1["tensor_pipe_pct"] == 57.85  # no gmma counter on this page: the busiest tensor pipe
    assert l1["cycles_per_issue"] == pytest.approx(2.56 + 1 + 1.08)  # every reason, the issue cycle included
    assert l1["top_stalls"] == "barrier 2.56; wait 1.08"  # the waits, largest first
    assert gather["top_stalls"] == "long_scoreboard 13.15"


def test_a_case_names_m_and_a_known_variant():
    assert pp._case("4096:w4a8") == (4096, "w4a8")
    for bad in ("4096", "kappa:4096", "4096:fp8"):
        with pytest.raises(SystemExit, match="a case is M:variant with variant one of kappa, w4a8"):
            pp._case(bad)
