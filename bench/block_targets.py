"""What each of the block's targets (docs/design.md, section 5) asks of its two parts, from a measured bench/block.py
run (no GPU).

The compiled baseline and the fused block call the same routed-experts op (docs/design.md, section 2: the
unfused routed op the reference model calls), and the same kernels run it in both. So a faster routed op takes the same
microseconds off both variants, and a target on compiled / fused is, in the end, a target on everything else.
For each M this splits both variants' measured times into

- the routed op (`routed_us`, the same in both: bench/block.py `routed_op_us`), and
- the rest (`compiled_rest_us`, `fused_rest_us`: everything else in each variant's own schedule, by
  difference, so that work hidden beside the routed op counts as nothing and contention it causes counts),

then solves each target for one part with the other as measured:

- ratio target t (1.3x at decode, 1.15x at prefill): (routed + compiled_rest) / (routed + fused_rest) >= t
  holds for routed <= (compiled_rest - t * fused_rest) / (t - 1) with the rest as measured (no routed speed
  at all when compiled_rest <= t * fused_rest), and for fused_rest <= compiled / t - routed with the routed op
  as measured;
- floor target (decode only: fused <= 1.3 x the block's floor): routed <= 1.3 floor - fused_rest, or
  fused_rest <= 1.3 floor - routed.

Each requirement is set against its part's floor: the routed op's is the bytes of the experts hit over the
measured copy rate (`routed_floor_us`); the rest's is the down- and up-projection floors (`serial_floor_us`),
which run before and after the routed experts in any schedule. The verdict names the part that could meet the
target alone, or says that both must move; `ceiling` (bench/block.py `ratio_ceiling`) bounds the ratio with
both moving.

    PYTHONPATH=. python3 bench/block_targets.py --out bench/results [--block bench/results/block.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import routed_op_us, router_floor_us  # noqa: E402
from bench.common import RESULTS_DIR, write_results  # noqa: E402
from latent_moe_fusion.kimi_k3_config import KimiK3MoEConfig  # noqa: E402

DECODE_MAX_M = 128  # the targets' decode sizes are M = 1, 8, 32, 128; M = 4096 is their prefill
DECODE_RATIO_TARGET = 1.3
PREFILL_RATIO_TARGET = 1.15
DECODE_FLOOR_TARGET = 1.3


@dataclass(frozen=True)
class Requirement:
    """One target solved for one part of the block with the other part as measured."""

    needed_us: float | None  # the most that part may take; None: no speed of it meets the target
    floor_us: float  # the least that part can take

    @property
    def reachable(self) -> bool:
        return self.needed_us is not None and self.needed_us >= self.floor_us


def ratio_requirements(compiled_rest_us: float, fused_rest_us: float, routed_us: float, target: float,
                       routed_floor_us: float, serial_floor_us: float) -> tuple[Requirement, Requirement]:
    """(routed op with the rest as measured, fused rest with the routed op as measured) for
    (routed + compiled_rest) / (routed + fused_rest) >= target."""
    slack = compiled_rest_us - target * fused_rest_us
    routed_needed = slack / (target - 1) if slack > 0 else None
    rest_needed = (routed_us + compiled_rest_us) / target - routed_us
    return Requirement(routed_needed, routed_floor_us), Requirement(rest_needed, serial_floor_us)


def floor_requirements(fused_rest_us: float, routed_us: float, block_floor_us: float, target: float,
                       routed_floor_us: float, serial_floor_us: float) -> tuple[Requirement, Requirement]:
    """(routed op with the rest as measured, fused rest with the routed op as measured) for
    routed + fused_rest <= target * block floor."""
    allowed = target * block_floor_us
    return Requirement(allowed - fused_rest_us, routed_floor_us), Requirement(allowed - routed_us, serial_floor_us)


def verdict(met: bool, routed: Requirement, rest: Requirement, ceiling: float | None = None,
            target: float | None = None) -> str:
    if met:
        return "met"
    alone = []
    if routed.reachable:
        alone.append(f"routed op <= {routed.needed_us:.1f} us")
    if rest.reachable:
        alone.append(f"rest <= {rest.needed_us:.1f} us")
    if alone:
        return "reachable by " + " or ".join(alone)
    if ceiling is not None and target is not None and ceiling < target:
        return f"out of reach: ceiling {ceiling:.3f}x"
    return "needs both parts to move"


def _fmt(us: float | None) -> str:
    return "none" if us is None else f"{us:.1f}"


def target_rows(block_json: dict[str, Any], cfg: KimiK3MoEConfig | None = None) -> list[dict[str, Any]]:
    """One row per M of a bench/block.py JSON: each target, what it needs of either part, and the verdict."""
    cfg = cfg or KimiK3MoEConfig()
    meta = block_json["meta"]
    ceilings = {"copy_bytes_per_s": meta["copy_TBps"] * 1e12, "bf16_flop_per_s": meta["bf16_TFLOPps"] * 1e12}
    # the benchmark's router: a BF16 [E, H] weight and an FP32 correction bias (KimiK3MoEBlock)
    gate_bytes = 2 * cfg.num_experts * cfg.hidden_size + 4 * cfg.num_experts
    rows = []
    for r in block_json["rows"]:
        m = r["M"]
        compiled, fused, block_floor = r["compiled_us"], r["compiled+fused_us"], r["floor_us"]
        routed = routed_op_us(r)
        routed_floor = r["untouched_floor_us"] - router_floor_us(gate_bytes, m, cfg.hidden_size, cfg.num_experts,
                                                                  ceilings)
        compiled_rest, fused_rest = compiled - routed, fused - routed
        decode = m <= DECODE_MAX_M
        ratio_target = DECODE_RATIO_TARGET if decode else PREFILL_RATIO_TARGET
        ratio = compiled / fused
        ratio_routed, ratio_rest = ratio_requirements(compiled_rest, fused_rest, routed, ratio_target, routed_floor,
                                                      r["serial_floor_us"])
        row = {
            "M": m, "compiled_us": compiled, "fused_us": fused, "floor_us": block_floor,
            "routed_us": routed, "routed_floor_us": routed_floor, "routed_share_of_compiled": routed / compiled,
            "compiled_rest_us": compiled_rest, "fused_rest_us": fused_rest, "rest_speedup": compiled_rest / fused_rest,
            "serial_floor_us": r["serial_floor_us"],
            "ratio_target": ratio_target, "fused_vs_compiled": ratio,
            "ratio_routed_needed_us": _fmt(ratio_routed.needed_us), "ratio_rest_needed_us": _fmt(ratio_rest.needed_us),
            "ceiling_fused_vs_compiled": r["ceiling_fused_vs_compiled"],
            "ratio_verdict": verdict(ratio >= ratio_target, ratio_routed, ratio_rest, r["ceiling_fused_vs_compiled"],
                                     ratio_target),
            "fused_x_floor": fused / block_floor,
        }
        if decode:
            floor_routed, floor_rest = floor_requirements(fused_rest, routed, block_floor, DECODE_FLOOR_TARGET,
                                                          routed_floor, r["serial_floor_us"])
            row |= {"floor_target": DECODE_FLOOR_TARGET, "floor_routed_needed_us": _fmt(floor_routed.needed_us),
                    "floor_rest_needed_us": _fmt(floor_rest.needed_us),
                    "floor_verdict": verdict(fused <= DECODE_FLOOR_TARGET * block_floor, floor_routed, floor_rest)}
        else:
            row |= {"floor_target": "-", "floor_routed_needed_us": "-", "floor_rest_needed_us": "-",
                    "floor_verdict": "no target at prefill"}
        rows.append(row)
    return rows


COLUMNS = ["M", "compiled_us", "fused_us", "floor_us", "routed_us", "routed_floor_us", "routed_share_of_compiled",
           "compiled_rest_us", "fused_rest_us", "rest_speedup", "serial_floor_us",
           "ratio_target", "fused_vs_compiled", "ratio_routed_needed_us", "ratio_rest_needed_us",
           "ceiling_fused_vs_compiled", "ratio_verdict",
           "floor_target", "fused_x_floor", "floor_routed_needed_us", "floor_rest_needed_us", "floor_verdict"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR))
    ap.add_argument("--block", default=None, help="a bench/block.py JSON (default: block.json in --out)")
    args = ap.parse_args()
    source = Path(args.block) if args.block else Path(args.out) / "block.json"
    if not source.is_file():
        raise SystemExit(f"{source} does not exist: run bench/block.py --out {source.parent} first, or pass --block")
    block_json = json.loads(source.read_text())
    rows = target_rows(block_json)
    meta = {k: v for k, v in block_json["meta"].items() if k not in ("timing", "untouched", "ceiling")}
    meta |= {"source": f"{source.name} of {block_json['meta'].get('date', '?')}",
             "split": "routed_us: the routed op as both variants run it (untouched - router chain - down-projection "
                      "- router GEMM); *_rest_us: the variant's time less routed_us; serial_floor_us: the down- and "
                      "up-projection floors (the rest's least); routed_floor_us: the experts hit, bytes over the "
                      "copy rate",
             "needed": "*_routed_needed_us: the most the routed op may take with the rest as measured (none: no "
                       "speed of it meets the target); *_rest_needed_us: the most the fused block's rest may take "
                       "with the routed op as measured"}
    write_results("block_targets", rows, COLUMNS, meta, args.out)
    plot(rows, Path(args.out) / "block_targets.png")
    for row in rows:
        print(f"M = {row['M']}: ratio {row['fused_vs_compiled']:.3f}x ({row['ratio_verdict']}); "
              f"x floor {row['fused_x_floor']:.2f} ({row['floor_verdict']})")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Per M, the compiled and fused block as routed op + rest, in units of the compiled block's time, with the
    time each target allows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.38
    for i, row in enumerate(rows):
        scale = row["compiled_us"]
        for offset, rest, label in ((-width / 2, row["compiled_rest_us"], "compiled"),
                                    (width / 2, row["fused_rest_us"], "fused")):
            ax.bar(i + offset, row["routed_us"] / scale, width, color="tab:gray",
                   label="routed op (both variants)" if i == 0 and label == "compiled" else None)
            ax.bar(i + offset, rest / scale, width, bottom=row["routed_us"] / scale,
                   color="tab:blue" if label == "compiled" else "tab:orange",
                   label=f"rest, {label}" if i == 0 else None)
        span = (i - width, i + width)
        ax.hlines(1 / row["ratio_target"], *span, colors="black", linestyles="--",
                  label="ratio target" if i == 0 else None)
        if row["floor_target"] != "-":
            ax.hlines(row["floor_target"] * row["floor_us"] / scale, *span, colors="tab:red", linestyles=":",
                      label="floor target" if i == 0 else None)
        ax.hlines(row["routed_floor_us"] / scale, *span, colors="tab:green", linewidth=1.5,
                  label="routed op floor" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [f"M = {row['M']}" for row in rows])
    ax.set_ylabel("time / compiled block's time")
    ax.set_title("Kimi K3 block, one rank (H200): where each target lies")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
