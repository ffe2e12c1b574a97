"""Fused producer (routed experts + shared expert + RMSNorm) on one rank of Kimi K3 at TP8/EP8.

    PYTHONPATH=. python3 bench/producer.py --out DIR [--sweep] [--quick]
    PYTHONPATH=. python3 bench/producer.py --out DIR --m 4096 8192 16384 32768 [--name producer_prefill]

112 local experts (of 896), top-16, I = 3072, L = 3584, shared intermediate 768 on H = 7168.
Routings (the `routing` column says which one each row ran):
  eight_global  each local row m carries the assignments that land on this rank from 8 global tokens (8m .. 8m+7,
                each with 16 distinct experts of 896 from random router scores), de-duplicated and cut to 16 slots,
                the rest -1; so the rank sees the expert load of 8x as many global tokens (~14 local pairs a row).
  ep_share      one token per row: its top-16 of 896 random router scores, the other ranks' experts -1 (~2 local pairs
                a row), as the block sees them and as the other prefill benchmarks route (bench/block.py,
                bench/peer_routed.py, bench/prefill_regs.py).
--routing auto (the default): without --m, eight_global at every M (the default sizes, decode 1 .. 128 and prefill
512, 4096, comparable with the committed bench/results/producer.md); with --m, eight_global at decode sizes (M <= 128)
and ep_share beyond, because at prefill eight_global would stand for 8x the batch (262144 global tokens at
M = 32768). --routing eight_global / ep_share forces one routing at every M.
Times are medians of CUDA-graph replays over rotating input sets (bench/common.py). Kernels: the op's own choice for
each call (run_experts without a config), or with --sweep the best candidate tiles. Floors, both reported: bytes (the
weights of the experts hit + shared weights + activations, moved once, over the measured copy bandwidth) and FLOPs
(2 * 3 * I * L per valid (token, slot) pair + 2 * 3 * H * I_s per token for the shared expert, over the BF16 matmul
rate measured in the same run); floor_us is the larger (the binding one, named in `bound`) and every *_over_floor
column is against it. Correctness against the reference op (FP32 on the GPU) in the same run: every row up to
M = 512 (CHECK_ROWS), beyond that 512 evenly spread rows (every output row depends on its own row of the inputs
only), so the reference stays within seconds at M = 32768. One M at a time: its inputs, outputs and graphs are freed
before the next M is built (the pair buffers at M = 32768 take tens of GB).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    environment,
    measure_ceilings,
    rel_l2,
    time_graph_ms,
    write_results,
)
from bench.peer_inputs import rank_routing  # noqa: E402
from bench.producer_stock import has_grouped_mm, stock_rms_norm, stock_routed, stock_shared  # noqa: E402
from latent_moe_fusion.cli_args import positive_int  # noqa: E402
from latent_moe_fusion.ops.common.reference_math import (  # noqa: E402
    rms_norm_math,
    routed_experts_math,
    shared_expert_math,
)
from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, run_experts  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import GemmTiles, ProducerConfig, pick_config  # noqa: E402
from latent_moe_fusion.ops.routed.routed_plan import RoutedPlan, plan_call  # noqa: E402
from latent_moe_fusion.ops.routed.triton.combine import launch_combine  # noqa: E402
from latent_moe_fusion.ops.routed.triton.moe_align import group_by_expert  # noqa: E402
from latent_moe_fusion.ops.routed.triton.weight_tiles import (  # noqa: E402
    DEQUANT_ASM,
    DEQUANT_ASM_PAIRS,
    DEQUANT_LUT,
)

GLOBAL_EXPERTS, LOCAL_EXPERTS, TOP_K, EP = 896, 112, 16, 8
LATENT, INTER, HIDDEN, INTER_S = 3584, 3072, 7168, 768
BETA, LIN_BETA, EPS = 4.0, 25.0, 1e-5
DECODE_M, PREFILL_M = (1, 8, 32, 128), (512, 4096)
DECODE_MAX_M = max(DECODE_M)  # the phase of an M given with --m: decode up to here, prefill beyond
QUICK_M = (1, 32, 512)
ROUTINGS = ("eight_global", "ep_share")
FORMATS = ("bf16", "mxfp4")
# Rows checked against the reference: all of them up to here (every default size but 4096), else this many spread
# evenly. The FP32 reference runs ~50 TFLOP/s: 512 eight_global rows (~7000 pairs) take a few seconds per format.
CHECK_ROWS = 512
DT = torch.bfloat16


def routing(m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """eight_global: ids [m, 16] (local expert ids or -1) and weights [m, 16] FP32, see the module docstring."""
    g = m * EP
    scores = torch.rand(g, GLOBAL_EXPERTS, generator=gen)
    top_s, top_i = scores.topk(TOP_K, dim=1)
    top_w = top_s / top_s.sum(1, keepdim=True)
    local = top_i < LOCAL_EXPERTS
    cand_i = torch.where(local, top_i, -1).view(m, EP * TOP_K)
    cand_w = top_w.view(m, EP * TOP_K)
    # De-duplicate each row (keep the first occurrence), valid first in token order, cut to 16.
    sorted_i, perm = cand_i.sort(dim=1, stable=True)
    dup = torch.zeros_like(sorted_i, dtype=torch.bool)
    dup[:, 1:] = (sorted_i[:, 1:] == sorted_i[:, :-1]) & (sorted_i[:, 1:] >= 0)
    keep = torch.zeros_like(dup).scatter_(1, perm, ~dup) & (cand_i >= 0)
    rank = torch.where(keep, torch.arange(EP * TOP_K).expand(m, -1), EP * TOP_K + 1)
    order = rank.argsort(dim=1, stable=True)[:, :TOP_K]
    ids = torch.where(keep.gather(1, order), cand_i.gather(1, order), -1)
    w = torch.where(ids >= 0, cand_w.gather(1, order), 0.0)
    return ids.to(torch.int32), w.float()


def routed_ids(kind: str, m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [m, 16] int32, local expert ids or -1; weights [m, 16] FP32) of one routing of ROUTINGS, on the CPU."""
    if kind == "eight_global":
        return routing(m, gen)
    if kind == "ep_share":
        return rank_routing(m, gen, "cpu", LOCAL_EXPERTS)
    raise ValueError(f"routing {kind!r}: expected one of {', '.join(ROUTINGS)}")


def make_weights(fmt: str, gen: torch.Generator) -> dict[str, torch.Tensor | None]:
    dev = "cuda"
    if fmt == "bf16":
        w13 = torch.randn(LOCAL_EXPERTS, 2 * INTER, LATENT, device=dev, dtype=DT) * LATENT**-0.5
        w2 = torch.randn(LOCAL_EXPERTS, LATENT, INTER, device=dev, dtype=DT) * INTER**-0.5
        return dict(w13=w13, w2=w2, w13_scale=None, w2_scale=None)

    # Random e2m1 codes with scales near 2^-6 (magnitudes like a 1/sqrt(3072) init).
    def packed(n: int, k: int) -> torch.Tensor:
        return torch.randint(0, 256, (LOCAL_EXPERTS, n, k // 2), device=dev, dtype=torch.uint8)

    def scales(n: int, k: int) -> torch.Tensor:
        return torch.randint(119, 123, (LOCAL_EXPERTS, n, k // 32), device=dev, dtype=torch.uint8)

    return dict(w13=packed(2 * INTER, LATENT), w2=packed(LATENT, INTER),
                w13_scale=scales(2 * INTER, LATENT), w2_scale=scales(LATENT, INTER))


def make_shared_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared expert gate [I_s, H], up [I_s, H], down [H, I_s] (BF16, 1/sqrt(fan-in) scale)."""
    return tuple(torch.randn(*shape, device="cuda", dtype=DT) * shape[1] ** -0.5
                 for shape in ((INTER_S, HIDDEN), (INTER_S, HIDDEN), (HIDDEN, INTER_S)))


def make_rms_weight() -> torch.Tensor:
    return (torch.rand(LATENT, device="cuda") + 0.5).to(DT)


def expert_bytes(fmt: str, latent: int = LATENT, inter: int = INTER) -> int:
    """Bytes of one expert's w13 and w2: BF16, or MXFP4 codes (two a byte) + one E8M0 scale per 32."""
    elems = 3 * inter * latent
    return elems * 2 if fmt == "bf16" else elems // 2 + elems // 32


def floor_terms(m: int, hit_experts: float, pairs: float, fmt: str, *, latent: int = LATENT, inter: int = INTER,
                hidden: int = HIDDEN, inter_s: int = INTER_S, top_k: int = TOP_K) -> tuple[float, float]:
    """(bytes the producer must move once, FLOPs it must do) for m rows with `pairs` valid (token, slot) pairs on
    `hit_experts` distinct local experts.

    Bytes: the weights of the experts hit, the shared expert's BF16 gate, up and down, z and x read and y and the
    shared output written (BF16), ids and router weights read (4 + 4 bytes a slot), the RMSNorm weight.
    FLOPs: 2 * 3 * I * L per pair (gate, up, down of the routed expert), 2 * 3 * H * I_s per row (the shared expert);
    the SiTU, the weighted sum and the RMSNorm are O(M * L) and left out."""
    act_bytes = m * (latent + hidden) * 2 * 2 + m * top_k * 8 + latent * 2
    shared_bytes = 3 * hidden * inter_s * 2
    nbytes = hit_experts * expert_bytes(fmt, latent, inter) + shared_bytes + act_bytes
    flops = 2 * pairs * 3 * inter * latent + 2 * m * 3 * hidden * inter_s
    return float(nbytes), float(flops)


def floors_us(nbytes: float, flops: float, ceilings: dict[str, float]) -> dict[str, Any]:
    """Both floors in us (bytes over the copy bandwidth, FLOPs over the BF16 matmul rate, as measure_ceilings
    names them), the binding one (their maximum) as floor_us, and which one binds."""
    bytes_us = nbytes / ceilings["copy_bytes_per_s"] * 1e6
    flop_us = flops / ceilings["bf16_flop_per_s"] * 1e6
    return {"bytes_floor_us": bytes_us, "flop_floor_us": flop_us, "floor_us": max(bytes_us, flop_us),
            "bound": "bytes" if bytes_us >= flop_us else "FLOPs"}


def check_rows(m: int, limit: int = CHECK_ROWS) -> torch.Tensor | None:
    """The rows checked against the reference: None (all of them) up to `limit` rows, else `limit` rows spread
    evenly from the first to the last (int64, on the CPU)."""
    if m <= limit:
        return None
    return torch.linspace(0, m - 1, limit, dtype=torch.float64).round().long().unique()


def make_sets(m: int, n_sets: int, gen: torch.Generator, routing_kind: str = "eight_global",
              ) -> list[dict[str, torch.Tensor]]:
    sets = []
    for _ in range(n_sets):
        ids, w = routed_ids(routing_kind, m, gen)
        sets.append(dict(
            z=torch.randn(m, LATENT, generator=gen).to(DT).cuda(),
            x=torch.randn(m, HIDDEN, generator=gen).to(DT).cuda(),
            ids=ids.cuda(), w=w.cuda(),
        ))
    return sets


class Case:
    """One (M, format) point: its input sets, weights and the callables that are timed."""

    def __init__(self, m: int, fmt: str, weights: dict[str, torch.Tensor | None],
                 shared_w: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rms_w: torch.Tensor,
                 sets: list[dict[str, torch.Tensor]], routing_kind: str = "eight_global") -> None:
        self.m, self.fmt, self.wt, self.sh, self.rms, self.sets = m, fmt, weights, shared_w, rms_w, sets
        self.routing = routing_kind
        rows = check_rows(m)
        self.rows = None if rows is None else rows.to(sets[0]["z"].device)
        self._refs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def routed_args(self, s: dict[str, torch.Tensor]) -> tuple:
        wt = self.wt
        return (s["z"], s["ids"], s["w"], wt["w13"], wt["w2"], wt["w13_scale"], wt["w2_scale"], self.fmt,
                BETA, LIN_BETA)

    def fused(self, i: int, config: ProducerConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.sets[i]
        out = torch.empty(self.m, HIDDEN, device="cuda", dtype=DT)
        y = run_experts(*self.routed_args(s), rms_weight=self.rms, eps=EPS,
                        shared=SharedExpert(s["x"], *self.sh, out), config=config)
        return y, out

    def fused_plan(self, config: ProducerConfig | None = None) -> RoutedPlan:
        """What fused(i, config) runs (the same for every set: the plan depends on the shapes, not the ids)."""
        s, wt = self.sets[0], self.wt
        return plan_call(s["z"], s["ids"], wt["w13"], wt["w2"], wt["w13_scale"], wt["w2_scale"], self.fmt, s["x"],
                         self.sh[0], config)

    def routed_only(self, i: int, config: ProducerConfig | None = None) -> torch.Tensor:
        return run_experts(*self.routed_args(self.sets[i]), config=config)

    def unfused_lmf(self, i: int, config: ProducerConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.sets[i]
        y = run_experts(*self.routed_args(s), config=config)
        return stock_rms_norm(y, self.rms, EPS), stock_shared(s["x"], *self.sh, BETA, LIN_BETA)

    def reference(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(routed), shared) of set i by the reference math, on the checked rows only (self.rows)."""
        if i not in self._refs:
            s = self.sets[i]
            if self.rows is not None:  # each output row is its input row's alone: the reference of a row subset
                s = {k: v[self.rows] for k, v in s.items()}
            y = routed_experts_math(*self.routed_args(s))
            self._refs[i] = (rms_norm_math(y, self.rms, EPS), shared_expert_math(s["x"], *self.sh, BETA, LIN_BETA))
        return self._refs[i]

    def error(self, i: int, y: torch.Tensor, shared_out: torch.Tensor) -> float:
        """The larger relative L2 of the two outputs of set i against the reference, on the checked rows."""
        if self.rows is not None:
            y, shared_out = y[self.rows], shared_out[self.rows]
        ry, rs = self.reference(i)
        return max(rel_l2(y, ry), rel_l2(shared_out, rs))

    def hit_experts(self) -> float:
        return sum(int(torch.unique(s["ids"][s["ids"] >= 0]).numel()) for s in self.sets) / len(self.sets)

    def pairs(self) -> float:
        return sum(int((s["ids"] >= 0).sum()) for s in self.sets) / len(self.sets)


class StockCase:
    """The unfused stock sequence on BF16 weights (grouped_mm + torch shared MLP + F.rms_norm)."""

    def __init__(self, case: Case, bf16_weights: dict[str, torch.Tensor | None]) -> None:
        self.c, self.wt = case, bf16_weights

    def routed(self, i: int) -> torch.Tensor:
        s = self.c.sets[i]
        return stock_routed(s["z"], s["ids"], s["w"], self.wt["w13"], self.wt["w2"], BETA, LIN_BETA)

    def unfused(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.c.sets[i]
        y = self.routed(i)
        return stock_rms_norm(y, self.c.rms, EPS), stock_shared(s["x"], *self.c.sh, BETA, LIN_BETA)


def decode_candidates(fmt: str) -> dict[str, ProducerConfig]:
    if fmt == "bf16":
        return {"d64x128s4": ProducerConfig(16, GemmTiles(64, 128, 4, 4), GemmTiles(64, 128, 4, 4), DEQUANT_ASM)}
    pairs, lut = DEQUANT_ASM_PAIRS, DEQUANT_LUT
    shared = dict(bk_shared=64, bn_shared=32)
    l2_tma = GemmTiles(64, 128, 4, 4, 32, 128, tma=True)
    return {
        # pointer loads and the bias-multiply PTX, the MXFP4 decode tiles before TMA + table lookup measured faster
        "m64x256s3r128_pairs": ProducerConfig(16, GemmTiles(64, 256, 4, 3, maxnreg=128, **shared),
                                              GemmTiles(64, 128, 4, 4, 32, 128), pairs),
        # TMA weight tiles + table lookup: L1 tile shapes (the first is today's default)
        "m64x128s4_lut_tma": ProducerConfig(16, GemmTiles(64, 128, 4, 4, tma=True, **shared), l2_tma, lut),
        "m64x128s3_lut_tma": ProducerConfig(16, GemmTiles(64, 128, 4, 3, tma=True, **shared), l2_tma, lut),
        "m64x256s3_lut_tma": ProducerConfig(16, GemmTiles(64, 256, 4, 3, tma=True, **shared), l2_tma, lut),
        "m64x256s3r128_lut_tma": ProducerConfig(16, GemmTiles(64, 256, 4, 3, maxnreg=128, tma=True, **shared), l2_tma, lut),
        "m64x256s2_lut_tma": ProducerConfig(16, GemmTiles(64, 256, 4, 2, tma=True, **shared), l2_tma, lut),
        "m128x128w8s4_lut_tma": ProducerConfig(16, GemmTiles(128, 128, 8, 4, tma=True, **shared), l2_tma, lut),
    }


def prefill_candidates(fmt: str) -> dict[str, ProducerConfig]:
    d = DEQUANT_ASM_PAIRS
    tma = dict(tma=True)
    if fmt == "bf16":
        return {"p128_l2_256": ProducerConfig(128, GemmTiles(128, 64, 8, 3), GemmTiles(256, 64, 8, 3), d),
                "p128_l2_256_tma": ProducerConfig(128, GemmTiles(128, 64, 8, 3, **tma), GemmTiles(256, 64, 8, 3, **tma), d)}
    return {"p128_128x64s3": ProducerConfig(128, GemmTiles(128, 64, 8, 3), GemmTiles(128, 64, 8, 3), d),
            "p128_128x64s3_tma": ProducerConfig(128, GemmTiles(128, 64, 8, 3, **tma), GemmTiles(128, 64, 8, 3, **tma), d),
            "p128_128x64s3_lut_tma": ProducerConfig(128, GemmTiles(128, 64, 8, 3, **tma), GemmTiles(128, 64, 8, 3, **tma),
                                                    DEQUANT_LUT)}


def config_name(c: ProducerConfig) -> str:
    def tiles(t: GemmTiles) -> str:
        return (f"{t.bn}x{t.bk}w{t.num_warps}s{t.num_stages}" + (f"k{t.bk_shared}" if t.bk_shared else "")
                + (f"n{t.bn_shared}" if t.bn_shared else "") + (f"r{t.maxnreg}" if t.maxnreg else "")
                + ("tma" if t.tma else ""))

    return f"bm{c.bm} l1:{tiles(c.l1)} l2:{tiles(c.l2)} dq{c.dequant}" + (" regs" if c.routed_regs else "")


def graph_us(fn: Callable[[int], Any], n_sets: int) -> float:
    try:
        return time_graph_ms(fn, n_sets) * 1e3
    finally:
        # The graph dies when time_graph_ms returns, but its private pool's blocks stay reserved until handed back:
        # one graph's buffers at a time (tens of GB at M = 32768), the next one's pool takes the memory afresh.
        torch.cuda.empty_cache()


def free_device_memory() -> None:
    """Hand back what the last M held: gc first, for graphs and outputs kept alive by reference cycles."""
    gc.collect()
    torch.cuda.empty_cache()


def phase_of(m: int) -> str:
    return "decode" if m <= DECODE_MAX_M else "prefill"


def routing_for(m: int, routing: str, sizes_given: bool) -> str:
    """The routing of one M (see the module docstring): `routing` unless it is "auto"; auto is eight_global
    everywhere for the default sizes, and with --m (sizes_given) eight_global at decode and ep_share at prefill."""
    if routing != "auto":
        return routing
    return "ep_share" if sizes_given and phase_of(m) == "prefill" else "eight_global"


def row_plan(args: argparse.Namespace) -> list[tuple[int, str, str]]:
    """(M, phase, routing) of every measured size, in order."""
    if args.m is not None:
        ms: Sequence[int] = args.m
    else:
        ms = QUICK_M if args.quick else DECODE_M + PREFILL_M
    return [(m, phase_of(m), routing_for(m, args.routing, args.m is not None)) for m in ms]


def make_cases(m: int, routing_kind: str, gen: torch.Generator, weights: dict[str, dict], shared_w: tuple,
               rms_w: torch.Tensor) -> dict[str, Case]:
    """One Case per weight format over the same input sets (4 at decode sizes, 2 beyond)."""
    sets = make_sets(m, 4 if m <= DECODE_MAX_M else 2, gen, routing_kind)
    return {fmt: Case(m, fmt, weights[fmt], shared_w, rms_w, sets, routing_kind) for fmt in FORMATS}


def sweep(make: Callable[[int], dict[str, Case]], log: Callable[[str], None]) -> dict:
    """Time each candidate config on the fused producer; returns {"best": {"phase/fmt": name}, "rows": [...]}."""
    best, rows = {}, []
    for phase, ms, candidates in (("decode", (32,), decode_candidates), ("prefill", (4096,), prefill_candidates)):
        totals: dict[tuple[str, str], float] = {}
        for m in ms:
            cases = make(m)
            for fmt in FORMATS:
                case = cases[fmt]
                for name, cfg in candidates(fmt).items():
                    try:
                        y, s = case.fused(0, cfg)
                        err = case.error(0, y, s)
                        del y, s
                        us = graph_us(lambda i, c=case, g=cfg: c.fused(i, g), len(case.sets))
                    except Exception as exc:  # a variant that does not compile is reported, not fatal
                        log(f"sweep {phase} {fmt} {name} M={m}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                        us, err = float("inf"), float("nan")
                    rows.append(dict(phase=phase, fmt=fmt, config=name, M=m, routing=case.routing, fused_us=us,
                                     err=err))
                    log(f"sweep {phase} {fmt} {name} M={m}: {us:.1f} us err {err:.2e}")
                    totals[(fmt, name)] = totals.get((fmt, name), 0.0) + (us if err < 1e-2 else float("inf"))
            del cases
            free_device_memory()
        for fmt in FORMATS:
            mine = {name: t for (f, name), t in totals.items() if f == fmt}
            best[(phase, fmt)] = min(mine, key=mine.get)
            log(f"best {phase} {fmt}: {best[(phase, fmt)]}")
    return {"best": {f"{k[0]}/{k[1]}": v for k, v in best.items()}, "rows": rows}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR), help="results folder (default bench/results)")
    ap.add_argument("--name", default="producer",
                    help="file stem of the results: NAME.json, NAME.md, NAME.png, NAME_log.txt, NAME_sweep.json "
                         "(default producer)")
    sizes = ap.add_mutually_exclusive_group()
    sizes.add_argument("--m", type=positive_int, nargs="+", metavar="M",
                       help=f"token counts, e.g. --m 4096 8192 16384 32768 (default: decode "
                            f"{' '.join(map(str, DECODE_M))}, prefill {' '.join(map(str, PREFILL_M))}); "
                            f"M <= {DECODE_MAX_M} is decode, larger prefill")
    sizes.add_argument("--quick", action="store_true",
                       help=f"M = {', '.join(map(str, QUICK_M))} only")
    ap.add_argument("--routing", choices=("auto", *ROUTINGS), default="auto",
                    help="routing of every M (auto: eight_global at the default sizes; with --m eight_global at "
                         "decode sizes and ep_share at prefill; see the module docstring)")
    ap.add_argument("--sweep", action="store_true", help="time candidate tile configs first and use the best")
    args = ap.parse_args(argv)
    if not args.name or Path(args.name).name != args.name or args.name in (".", ".."):
        ap.error(f"--name {args.name!r}: expected a file stem, without a folder (the folder is --out)")
    if args.m is not None:
        args.m = list(dict.fromkeys(args.m))  # one row per size: a repeated M would only be timed twice
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("producer: needs a CUDA GPU (the figures are for an H200); nothing was run", file=sys.stderr)
        return 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"{args.name}_log.txt"
    log_path.write_text("")

    def log(msg: str) -> None:
        print(msg, flush=True)
        with log_path.open("a") as f:
            f.write(msg + "\n")

    points = row_plan(args)
    meta = environment()
    ceilings = measure_ceilings()
    bw, rate = ceilings["copy_bytes_per_s"], ceilings["bf16_flop_per_s"]
    meta.update(copy_TBps=round(bw / 1e12, 3), bf16_TFLOPs=round(rate / 1e12, 1), grouped_mm=has_grouped_mm(),
                config=f"E_local={LOCAL_EXPERTS}/{GLOBAL_EXPERTS} top{TOP_K} I={INTER} L={LATENT} H={HIDDEN} "
                       f"I_s={INTER_S}",
                routing="; ".join(f"M={m}: {r}" for m, _, r in points) + " (eight_global: each row the local "
                        f"assignments of {EP} global tokens; ep_share: one token per row, other ranks' experts -1)",
                floor=FLOOR_NOTE, check=CHECK_NOTE)
    log(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 {rate / 1e12:.0f} TFLOP/s")

    gen = torch.Generator().manual_seed(1234)
    weights = {fmt: make_weights(fmt, gen) for fmt in FORMATS}
    shared_w = make_shared_weights()
    rms_w = make_rms_weight()

    chosen: dict[tuple[str, str], ProducerConfig] = {}
    if args.sweep:
        sweep_result = sweep(lambda m: make_cases(m, routing_for(m, args.routing, args.m is not None), gen, weights,
                                                  shared_w, rms_w), log)
        for key, name in sweep_result["best"].items():
            phase, fmt = key.split("/")
            cands = decode_candidates(fmt) if phase == "decode" else prefill_candidates(fmt)
            chosen[(phase, fmt)] = cands[name]
        meta["sweep_best"] = sweep_result["best"]
        (out_dir / f"{args.name}_sweep.json").write_text(json.dumps(sweep_result, indent=2) + "\n")
    meta["chosen_configs"] = {f"{k[0]}/{k[1]}": asdict(v) for k, v in chosen.items()}

    rows: list[dict] = []
    for m, phase, routing_kind in points:
        free_device_memory()
        torch.cuda.reset_peak_memory_stats()
        cases = make_cases(m, routing_kind, gen, weights, shared_w, rms_w)
        stock = _measure_stock(cases["bf16"], weights["bf16"], log)
        done = []
        for fmt in FORMATS:
            cfg = None  # the op's own choice
            if (phase, fmt) in chosen:  # the sweep's tiles, with the block rows the batch needs
                cfg = replace(chosen[(phase, fmt)], bm=pick_config(m * TOP_K, fmt, DT, LOCAL_EXPERTS).bm)
            try:
                row = _measure_row(cases[fmt], phase, cfg, stock, ceilings)
            except Exception as exc:  # keep the other rows
                log(f"M={m} {fmt}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
                continue
            done.append(row)
            log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        peak_gb = torch.cuda.max_memory_allocated() / 1e9
        for row in done:
            row["peak_GB"] = peak_gb
        log(f"M={m}: peak memory allocated {peak_gb:.1f} GB")
        rows += done
        del cases, stock, done
        _write(rows, meta, out_dir, args.name)
    free_device_memory()
    _plot(rows, out_dir / f"{args.name}.png")
    return 0


COLUMNS = ["phase", "M", "routing", "format", "experts_hit", "pairs", "config", "kernels", "fused_us",
           "unfused_stock_us", "unfused_lmf_us", "grouped_mm_us", "routed_triton_us", "bytes_floor_us", "flop_floor_us",
           "floor_us", "bound", "fused_over_floor", "unfused_lmf_over_floor", "unfused_stock_over_floor",
           "speedup_vs_stock", "speedup_vs_lmf_unfused", "mxfp4_speedup_vs_bf16", "routed_TFLOPs", "fused_err",
           "stock_err", "peak_GB"]
FLOOR_NOTE = ("bytes_floor_us: bytes moved once (weights of the experts hit + shared weights + activations) / copy "
              "BW; flop_floor_us: FLOPs (2*3*I*L per valid (token, slot) pair + 2*3*H*I_s per token) / BF16 matmul "
              "rate, both measured in this run; floor_us = the larger, `bound` names it; *_over_floor = time / "
              "floor_us (the format's floor for every column, the stock's BF16 weights included)")
CHECK_NOTE = (f"fused_err, stock_err: relative L2 of RMSNorm(routed) and of the shared output against the reference "
              f"math (FP32 on the GPU), the larger; every row up to M = {CHECK_ROWS}, else {CHECK_ROWS} rows spread "
              f"evenly")
NOTES = ("unfused_stock: torch._grouped_mm on BF16 weights (also for the mxfp4 rows: no stock MXFP4 grouped GEMM "
         "on Hopper) + shared MLP in torch + F.rms_norm; grouped_mm: its routed part alone. unfused_lmf: the lmf "
         "routed op + torch shared MLP + F.rms_norm; routed_triton: the lmf routed op alone. kernels: the routed "
         "kernel family the fused call ran. Times: CUDA graph replay, us per call, rotating input sets. "
         f"{FLOOR_NOTE}. pairs: valid (token, slot) pairs, mean over the sets. peak_GB: the most device memory "
         "allocated while the M ran.")


def _write(rows: list[dict], meta: dict, out_dir: Path, name: str) -> None:
    for row in rows:
        bf = next((r for r in rows if r["M"] == row["M"] and r["routing"] == row["routing"]
                   and r["format"] == "bf16"), None)
        if row["format"] == "mxfp4" and bf is not None:
            row["mxfp4_speedup_vs_bf16"] = bf["fused_us"] / row["fused_us"]
    write_results(name, rows, COLUMNS, meta, out_dir, NOTES)


def _measure_stock(case: Case, bf16_weights: dict, log: Callable[[str], None]) -> dict[str, float]:
    nan = float("nan")
    if not has_grouped_mm():
        return dict(unfused_us=nan, routed_us=nan, err=nan)
    try:
        stock = StockCase(case, bf16_weights)
        n_sets = len(case.sets)
        sy, ss = stock.unfused(0)
        err = case.error(0, sy, ss)
        del sy, ss
        return dict(unfused_us=graph_us(stock.unfused, n_sets), routed_us=graph_us(stock.routed, n_sets), err=err)
    except Exception as exc:
        log(f"stock M={case.m}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
        return dict(unfused_us=nan, routed_us=nan, err=nan)


def _measure_row(case: Case, phase: str, cfg: ProducerConfig | None, stock: dict[str, float],
                 ceilings: dict[str, float]) -> dict[str, Any]:
    m, fmt, n_sets = case.m, case.fmt, len(case.sets)
    plan = case.fused_plan(cfg)
    y, s = case.fused(0, cfg)
    err = case.error(0, y, s)
    y2, s2 = case.fused(0, cfg)
    deterministic = bool(torch.equal(y, y2) and torch.equal(s, s2))
    del y, s, y2, s2  # not held through the timings
    fused_us = graph_us(lambda i: case.fused(i, cfg), n_sets)
    lmf_unfused_us = graph_us(lambda i: case.unfused_lmf(i, cfg), n_sets)
    routed_us = graph_us(lambda i: case.routed_only(i, cfg), n_sets)
    hit, pairs = case.hit_experts(), case.pairs()
    nbytes, flops = floor_terms(m, hit, pairs, fmt)
    floors = floors_us(nbytes, flops, ceilings)
    floor = floors["floor_us"]
    routed_flops = 2 * pairs * 3 * INTER * LATENT
    row = dict(
        phase=phase, M=m, routing=case.routing, format=fmt, experts_hit=round(hit, 1), pairs=round(pairs, 1),
        config=config_name(plan.config), kernels=plan.family,
        fused_us=fused_us, unfused_stock_us=stock["unfused_us"], unfused_lmf_us=lmf_unfused_us,
        grouped_mm_us=stock["routed_us"], routed_triton_us=routed_us, **floors,
        bytes_MB=nbytes / 1e6, GFLOP=flops / 1e9,
        fused_over_floor=fused_us / floor, unfused_lmf_over_floor=lmf_unfused_us / floor,
        unfused_stock_over_floor=stock["unfused_us"] / floor, speedup_vs_stock=stock["unfused_us"] / fused_us,
        speedup_vs_lmf_unfused=lmf_unfused_us / fused_us,
        routed_TFLOPs=routed_flops / (routed_us * 1e-6) / 1e12,
        fused_err=err, stock_err=stock["err"], deterministic=deterministic,
    )
    if phase == "prefill":
        # GEMM-only time: the routed op minus its grouping and combine launches.
        block_m = plan.block_m or plan.config.bm
        grp = graph_us(lambda i: _group_and_combine(case, i, block_m), n_sets)
        row["routed_gemm_us"] = routed_us - grp
        row["routed_gemm_TFLOPs"] = routed_flops / ((routed_us - grp) * 1e-6) / 1e12
        row["gemm_frac_of_bf16_peak"] = row["routed_gemm_TFLOPs"] * 1e12 / ceilings["bf16_flop_per_s"]
    return row


def _group_and_combine(case: Case, i: int, block_m: int) -> None:
    s = case.sets[i]
    group_by_expert(s["ids"], LOCAL_EXPERTS, block_m)
    pairs = torch.empty(s["ids"].numel(), LATENT, device="cuda", dtype=torch.float32)
    launch_combine(pairs, s["ids"], s["w"], torch.empty_like(s["z"]), None, 0.0)


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, fmt in zip(axes, FORMATS, strict=True):
        sel = [r for r in rows if r["format"] == fmt]
        xs = range(len(sel))
        width = 0.2
        for k, (key, label) in enumerate([("floor_us", "floor (binding: bytes or FLOPs)"),
                                          ("fused_us", "fused"), ("unfused_lmf_us", "unfused, lmf routed"),
                                          ("unfused_stock_us", "unfused stock (grouped_mm bf16)")]):
            ax.bar([x + (k - 1.5) * width for x in xs], [r[key] for r in sel], width, label=label)
        ax.set_xticks(list(xs), [f"{r['phase'][0]} M={r['M']}" + (" ep" if r["routing"] == "ep_share" else "")
                                 for r in sel])
        ax.set_yscale("log")
        ax.set_ylabel("us per call (CUDA graph)")
        ax.set_title(f"producer, routed weights {fmt}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
