"""bench/ncu_routed.py reads the metrics and stall reasons of each kernel's last profiled launch in an ncu raw page."""

from bench.ncu_routed import parse, summarize

RAW = """==PROF== Profiling "routed_gemv_l1_kernel": 0%....50%....100% - 9 passes
  routed_gemv_l1_kernel (3072, 1, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Metric Name                                         Metric Unit  Metric Value
    gpu__time_duration.sum                                       us          4.00
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio     16.30
  routed_gemv_l1_kernel (3072, 1, 1)x(32, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    dram__throughput.avg.pct_of_peak_sustained_elapsed            %         30.47
    gpu__time_duration.sum                                       us         33.44
    sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active   %         62.89
    sm__warps_active.avg.per_cycle_active                      warp      1,434.00
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio      1.71
    smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio   0.92
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio              0.01
    smsp__issue_active.avg.pct_of_peak_sustained_active           %         62.40
"""


def test_parse_keeps_one_row_per_kernel_with_its_metrics():
    rows = parse(RAW)
    assert [r["kernel"] for r in rows] == ["routed_gemv_l1_kernel"] * 2
    assert rows[0]["ncu_us"] == 4.0 and rows[0]["stalls"] == {"long_scoreboard": 16.3}
    last = rows[1]
    assert (last["ncu_us"], last["alu_pipe_pct"], last["issue_pct"], last["dram_pct"]) == (33.44, 62.89, 62.4, 30.47)
    assert last["warps_per_sm"] == 1434.0 and last["threads"] == 32


def test_summary_takes_each_kernels_last_launch_and_its_main_stalls():
    (row,) = summarize("1", "default", RAW)
    assert (row["M"], row["variant"], row["ncu_us"]) == (1, "default", 33.44)
    assert row["top_stalls"] == "long_scoreboard 1.71; math_pipe_throttle 0.92"  # below 0.1 left out


def test_summary_gives_a_row_per_kernel():
    l2 = RAW.replace("routed_gemv_l1_kernel (3072", "l2_regs_kernel (448").split("\n")
    l2 = "\n".join(line for line in l2 if "Profiling" not in line)
    rows = summarize("8", "mma", RAW + l2)
    assert [r["kernel"] for r in rows] == ["routed_gemv_l1_kernel", "l2_regs_kernel"]
    assert all(r["ncu_us"] == 33.44 for r in rows)


def test_durations_in_other_units_come_out_in_us():
    rows = parse(RAW.replace("us         33.44", "ms          1.09").replace("us          4.00", "ns        900.00"))
    assert [r["ncu_us"] for r in rows] == [0.9, 1090.0]


def test_the_staged_profile_reads_its_extra_metrics_per_kernel():
    from bench.ncu_staged import extra_values

    staged = RAW.replace("routed_gemv_l1_kernel (3072", "l1_staged_kernel (29952").replace(
        "    smsp__issue_active", "    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active   %   44.38\n"
        "    l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum      8,102,441\n    smsp__issue_active")
    assert extra_values(staged) == [{}, {"tensor_pipe_pct": 44.38, "smem_bank_conflicts": 8102441.0}]
