"""The routed family's measured size thresholds: routed_thresholds.json beside this file (package data), one entry per
module constant of the same name in upper case (producer_config.DECODE_PAIRS reads "decode_pairs", ...), each with
its unit, what it decides, and the device, date, rule and source of its measurement."""

from __future__ import annotations

from pathlib import Path

from ..common.measured_tables import load_table

TABLE_PATH = Path(__file__).resolve().with_name("routed_thresholds.json")
NAMES = (
    "decode_pairs",  # producer_config
    "routed_gemv_max_pairs",  # routed_gemv
    "split_k_max_pairs",  # producer_config
    "few_tokens_split_max_pairs",  # producer_config
    "l2_tma_max_pairs",  # gluon
    "prefill_regs_few_rows",  # producer_config
    "prefill_staged_min_rows",  # producer_config
    "prefill_regs_max_rows",  # producer_config
    "prefill_choice_max_rows",  # producer_config
    "spread_min_pairs",  # triton/moe_align
    "group_after_fork_max_tokens",  # schedule_rules
    "shared_side_max_tokens",  # schedule_rules
    "shared_cublas_side_max_tokens",  # schedule_rules
    "grid_shared_max_tokens",  # schedule_rules
    "overlap_max_tokens",  # router_fused/route_and_project
    "shared_first_min_tokens",  # router_fused/route_and_produce
    "shared_first_max_tokens",  # router_fused/route_and_produce
    "router_first_max_tokens",  # router_fused/route_and_produce
    "urgent_max_tokens",  # router_fused/route_and_produce
)
ROUTED_THRESHOLDS = load_table(TABLE_PATH, NAMES)
