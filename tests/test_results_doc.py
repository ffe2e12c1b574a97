"""docs/results.md's tables say what the committed results say: each table's figures against the JSON of the file it
names (bench/results/), rounded to the digits shown. A new `make bench` run fails these until the page is in step."""

import pytest

from tests.doc_tables import agrees, check_block_table, check_cells, numbers, result, rows_by, table

DOC = "docs/results.md"


def test_block_table_is_block_json():
    check_block_table(DOC)


def test_block_variants_table_is_block_json():
    measured = rows_by("block", "M")
    keys = ["compiled+fused_us", "compiled+fused-no-router_us", "compiled+fused-no-overlap_us",
            "compiled+fused-no-shared-first_us", "untouched_us", "router_chain_us", "down_projection_us",
            "router_gemm_us", "max_fused_vs_compiled"]
    for cells in table(DOC, "| M | compiled + fused us | no router rewrite us |"):
        row = measured[int(cells[0])]
        check_cells(f"block variants M = {cells[0]}", cells[1:], [row[k] for k in keys])


@pytest.mark.parametrize("column, keys", [
    (1, ("fused_vs_compiled", "ratio_target")),
    (2, ("fused_x_floor",)),
    (3, ("routed_us", "routed_floor_us")),
    (4, ("compiled_rest_us", "fused_rest_us", "serial_floor_us")),
])
def test_targets_table_is_block_targets_json(column, keys):
    derived = rows_by("block_targets", "M")
    rows = table(DOC, "| M | fused / compiled (target) |")
    assert [int(r[0]) for r in rows] == sorted(derived)
    for cells in rows:
        row = derived[int(cells[0])]
        shown = numbers(cells[column])[: len(keys)]
        assert len(shown) == len(keys), f"M = {cells[0]}: {cells[column]!r} lacks figures for {keys}"
        for key, figure in zip(keys, shown, strict=True):
            assert agrees(figure, row[key]), f"targets M = {cells[0]} {key}: {figure} against {row[key]:.4g}"


def test_block_targets_json_is_derived_from_block_json():
    """block_targets.json was made from the block.json the block table shows (same run)."""
    assert result("block_targets")["meta"]["date"] == result("block")["meta"]["date"], \
        "re-run bench/block_targets.py after bench/block.py"


def test_two_gpu_table_is_block_tp_json():
    measured = rows_by("block_tp", "form", "M")
    keys = ["compiled_us", "compiled+fused_us", "fused_vs_compiled", "compiled+fused-nccl_us", "fused_nccl_vs_compiled"]
    rows = table(DOC, "| form | M | compiled us | fused, symmetric us |")
    assert len(rows) == len(measured)
    for cells in rows:
        row = measured[cells[0], int(numbers(cells[1])[0])]
        check_cells(f"two GPUs {cells[0]} M = {cells[1]}", cells[2:], [row[k] for k in keys])


def test_exchange_table_is_tp_json():
    measured = rows_by("tp", "part", "M")
    parts = ["TP fragments", "SP fragments", "TP output all-gather", "TP tail"]
    for cells in table(DOC, "| M | TP fragments, symmetric / NCCL us |"):
        m = int(cells[0])
        for part, cell in zip(parts, cells[1:], strict=True):
            symm, nccl = numbers(cell)
            row = measured[part, m]
            assert agrees(symm, row["symm_us"]) and agrees(nccl, row["nccl_us"]), f"tp {part} M = {m}: {cell}"


def test_tail_table_is_tail_cute_json():
    measured = rows_by("tail_cute", "M", "R")
    rows = table(DOC, "| M | R | unfused (cuBLAS mm + FP32 sum + add) us |")
    assert rows
    for cells in rows:
        row = measured[int(cells[0]), int(cells[1])]
        best = min(row["triton_us"], row["cute_us"]) / row["floor_us"]
        check_cells(f"tail M = {cells[0]} R = {cells[1]}", cells[2:],
                    [row["unfused_us"], row["triton_us"], row["cute_us"], row["floor_us"], best])


def test_producer_table_is_producer_json():
    measured = rows_by("producer", "phase", "M", "format")
    keys = ["fused_us", "unfused_stock_us", "floor_us", "fused_over_floor", "speedup_vs_stock"]
    rows = table(DOC, "| phase | M | weights | fused us | stock us |")
    assert len(rows) == len(measured)
    for cells in rows:
        row = measured[cells[0], int(cells[1]), cells[2]]
        check_cells(f"producer {cells[:3]}", cells[3:], [row[k] for k in keys])


def test_routed_fp8_table_is_routed_fp8_json():
    l1 = {r["M"]: r for r in result("routed_fp8")["rows"] if r["variant"] == "pipe,8"}
    op = rows_by("routed_fp8_layers", "M")
    for cells in table(DOC, "| M | bf16 L1 (us, x floor) | FP8 L1 (us, x floor) |"):
        m = int(cells[0])
        figures = [float(x) for x in numbers(cells[1]) + numbers(cells[2]) + numbers(cells[3])]
        values = [l1[m]["bf16_l1_us"], l1[m]["bf16_x_floor"], l1[m]["fp8_l1_us"], l1[m]["fp8_x_floor"],
                  op[m]["routed_bf16_us"], op[m]["routed_fp8_l1_us"], op[m]["routed_fp8_l1_vs_bf16"]]
        shown = numbers(cells[1]) + numbers(cells[2]) + numbers(cells[3])
        assert len(figures) == len(values), cells
        for figure, value in zip(shown, values, strict=True):
            assert agrees(figure, value), f"routed FP8 M = {m}: {figure} against {value:.4g}"


def test_routed_gemv_table_is_routed_gemv_json():
    measured = rows_by("routed_gemv", "M", "variant")
    for cells in table(DOC, "| M | pairs | wgmma path us | GEMV 2x2 us |"):
        m = int(cells[0])
        mma, g2, g4 = (measured[m, v] for v in ("mma", "gemv 2x2x64w1p2", "gemv 4x4x64w1p2"))
        best = min(mma["us"], g2["us"], g4["us"]) / mma["floor_us"]
        check_cells(f"routed GEMV M = {m}", cells[1:], [mma["pairs"], mma["us"], g2["us"], g4["us"], mma["floor_us"], best])


def test_prefill_table_is_prefill_regs_json():
    measured = rows_by("prefill_regs", "routing", "M", "setting")
    settings = ["triton tiles", "regs 32 forced", "regs 64 forced", "staged 128 forced", "gpu choice", "default"]
    rows = table(DOC, "| routing | M | rows per hit expert | Triton tiles us |")
    for cells in rows:
        routing, m = cells[0].lower().replace(" ", "_"), int(cells[1])
        default = measured[routing, m, "default"]
        for setting, cell in zip(settings, cells[3:9], strict=True):
            if cell == "-":
                assert (routing, m, setting) not in measured, f"prefill {routing} M = {m}: {setting} was measured"
                continue
            check_cells(f"prefill {routing} M = {m} {setting}", [cell], [measured[routing, m, setting]["us"]])
        check_cells(f"prefill {routing} M = {m}", [cells[2], cells[9], cells[10], cells[11]],
                    [default["rows_per_hit_expert"], default["block_rows"], default["vs_triton_tiles"],
                     default["x_floor"]])


def test_prefill_kernels_table_is_prefill_kernels_json():
    measured = rows_by("prefill_kernels", "M")
    rows = table(DOC, "| M | staged us | kappa plain us | kappa us | ws us |")
    assert [int(r[0]) for r in rows] == sorted(measured)
    for cells in rows:
        r = measured[int(cells[0])]
        shares = [100 * r[f"{k}_share_of_bf16_rate"] for k in ("staged", "kappa_plain", "kappa")]
        check_cells(f"prefill kernels M = {cells[0]}", cells[1:16],
                    [r["staged_us"], r["kappa_plain_us"], r["kappa_us"], r["ws_us"], r["kappa_speedup"],
                     r["tiers_speedup"], r["ws_speedup"], r["floor_us"], *shares, r["kappa_plain_l1_us"],
                     r["kappa_l1_us"], r["kappa_gather_us"], r["staged_l1_us"]])
        for cell, l2 in ((cells[12], "kappa_plain_l2_us"), (cells[13], "kappa_l2_us"), (cells[15], "staged_l2_us")):
            assert agrees(numbers(cell)[1], r[l2]), f"prefill kernels M = {cells[0]} {l2}: {cell}"


def test_peer_table_is_peer_routed_json():
    """One table, every M of peer_routed.json: decode and prefill from one run."""
    measured = rows_by("peer_routed", "M")
    keys = ["local_pairs", "ours_us", "peer_us", "peer+hint_us", "grouped_mm_bf16_us", "floor_us",
            "ours_speedup_vs_peer", "ours_x_floor", "peer_x_floor", "ours_err", "peer_err"]
    rows = table(DOC, "| M | local pairs | ours us | peer us | peer + hint us | grouped_mm BF16 us |")
    assert [int(r[0]) for r in rows] == sorted(measured)
    for cells in rows:
        r = measured[int(cells[0])]
        check_cells(f"peer M = {cells[0]}", cells[1:], [r[k] for k in keys])


def test_router_chain_table_is_route_json():
    measured = rows_by("route", "M")
    columns = ["eager_us", "compiled_us", "compiled+fused_us", "fused_vs_compiled", "floor_us", "one_kernel_us"]
    rows = table(DOC, "| M | eager us | compiled us | fused us | fused / compiled | floor us | one kernel us |")
    assert [int(r[0]) for r in rows] == sorted(measured)
    for cells in rows:
        row = measured[int(cells[0])]
        check_cells(f"router M = {cells[0]}", cells[1:7], [row[k] for k in columns])
        assert (cells[7] == "yes") is row["ids_equal_compiled"], f"router M = {cells[0]}: ids {cells[7]}"
        check_cells(f"router M = {cells[0]} weights", [cells[8]], [row["weights_rel_l2_vs_compiled"]])


def test_router_overlap_table_is_router_overlap_json():
    measured = rows_by("router_overlap", "M")
    keys = ["one_stream_us", "side_by_side_us", "side_by_side_speedup", "down_projection_alone_us", "router_alone_us",
            "floor_us", "side_by_side_x_floor"]
    for cells in table(DOC, "| M | one stream us | two streams us |"):
        row = measured[int(cells[0])]
        check_cells(f"router overlap M = {cells[0]}", cells[1:], [row[k] for k in keys])


def test_down_projection_table_is_down_projection_json():
    measured = rows_by("down_projection", "M", "variant")
    for cells in table(DOC, "| M | Triton config (the table's) |"):
        m = int(cells[0])
        cublas, triton = measured[m, "cublas"], measured[m, "triton table"]
        assert cells[1] == triton["config"], f"down-projection M = {m}: {cells[1]} is not {triton['config']}"
        check_cells(f"down-projection M = {m}", cells[2:], [cublas["us"], triton["us"], triton["floor_us"],
                                                            triton["vs_cublas"], triton["x_floor"]])
