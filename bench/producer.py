"""Fused producer (routed experts + shared expert + RMSNorm) on one rank of Kimi K3 at TP8/EP8.

    PYTHONPATH=. python3 bench/producer.py --out DIR [--sweep] [--quick]

112 local experts (of 896), top-16, I = 3072, L = 3584, shared intermediate 768 on H = 7168.
Routing: each local row m carries the assignments that land on this rank from 8 global tokens
(8m .. 8m+7, each with 16 distinct experts of 896 from random router scores), de-duplicated and
cut to 16 slots, the rest -1; so the rank sees the expert load of 8x as many global tokens.
Times are medians of CUDA-graph replays over rotating input sets (bench/common.py); the floor is
the bytes the producer must move once (weights of the experts hit + shared weights + activations)
over the measured copy bandwidth. Correctness against the reference op is checked in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, write_results
from bench.producer_stock import has_grouped_mm, stock_rms_norm, stock_routed, stock_shared
from latent_moe_fusion.ops.common.reference_math import rms_norm_math, routed_experts_math, shared_expert_math
from latent_moe_fusion.ops.routed.expert_schedule import SharedExpert, run_experts
from latent_moe_fusion.ops.routed.producer_config import GemmTiles, ProducerConfig, pick_config
from latent_moe_fusion.ops.routed.triton.combine import launch_combine
from latent_moe_fusion.ops.routed.triton.moe_align import group_by_expert
from latent_moe_fusion.ops.routed.triton.weight_tiles import DEQUANT_ASM, DEQUANT_ASM_PAIRS, DEQUANT_LUT

GLOBAL_EXPERTS, LOCAL_EXPERTS, TOP_K, EP = 896, 112, 16, 8
LATENT, INTER, HIDDEN, INTER_S = 3584, 3072, 7168, 768
BETA, LIN_BETA, EPS = 4.0, 25.0, 1e-5
DECODE_M, PREFILL_M = (1, 8, 32, 128), (512, 4096)
DT = torch.bfloat16


def routing(m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [m, 16] (local expert ids or -1) and weights [m, 16] FP32, see the module docstring."""
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


def make_weights(fmt: str, gen: torch.Generator) -> dict[str, torch.Tensor | None]:
    dev = "cuda"
    if fmt == "bf16":
        w13 = torch.randn(LOCAL_EXPERTS, 2 * INTER, LATENT, device=dev, dtype=DT) * LATENT**-0.5
        w2 = torch.randn(LOCAL_EXPERTS, LATENT, INTER, device=dev, dtype=DT) * INTER**-0.5
        return dict(w13=w13, w2=w2, w13_scale=None, w2_scale=None)
    # Random e2m1 codes with scales near 2^-6 (magnitudes like a 1/sqrt(3072) init).
    def packed(n, k):
        return torch.randint(0, 256, (LOCAL_EXPERTS, n, k // 2), device=dev, dtype=torch.uint8)

    def scales(n, k):
        return torch.randint(119, 123, (LOCAL_EXPERTS, n, k // 32), device=dev, dtype=torch.uint8)

    return dict(w13=packed(2 * INTER, LATENT), w2=packed(LATENT, INTER),
                w13_scale=scales(2 * INTER, LATENT), w2_scale=scales(LATENT, INTER))


def make_shared_weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared expert gate [I_s, H], up [I_s, H], down [H, I_s] (BF16, 1/sqrt(fan-in) scale)."""
    return tuple(torch.randn(*shape, device="cuda", dtype=DT) * shape[1] ** -0.5
                 for shape in ((INTER_S, HIDDEN), (INTER_S, HIDDEN), (HIDDEN, INTER_S)))


def make_rms_weight() -> torch.Tensor:
    return (torch.rand(LATENT, device="cuda") + 0.5).to(DT)


def floor_us(case: Case, bytes_per_s: float) -> float:
    """Bytes the producer must move once (weights of the experts hit + shared weights + activations)
    over the copy bandwidth, in us."""
    m = case.m
    act_bytes = m * (LATENT + HIDDEN) * 2 * 2 + m * TOP_K * 8 + LATENT * 2
    shared_bytes = sum(w.numel() * w.element_size() for w in case.sh)
    return (case.hit_experts() * expert_bytes(case.fmt) + shared_bytes + act_bytes) / bytes_per_s * 1e6


def expert_bytes(fmt: str) -> int:
    elems = 3 * INTER * LATENT
    return elems * 2 if fmt == "bf16" else elems // 2 + elems // 32


def make_sets(m: int, n_sets: int, gen: torch.Generator) -> list[dict[str, torch.Tensor]]:
    sets = []
    for _ in range(n_sets):
        ids, w = routing(m, gen)
        sets.append(dict(
            z=torch.randn(m, LATENT, generator=gen).to(DT).cuda(),
            x=torch.randn(m, HIDDEN, generator=gen).to(DT).cuda(),
            ids=ids.cuda(), w=w.cuda(),
        ))
    return sets


class Case:
    """One (M, format) point: its input sets, weights and the callables that are timed."""

    def __init__(self, m, fmt, weights, shared_w, rms_w, sets):
        self.m, self.fmt, self.wt, self.sh, self.rms, self.sets = m, fmt, weights, shared_w, rms_w, sets
        self._refs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def routed_args(self, s):
        wt = self.wt
        return (s["z"], s["ids"], s["w"], wt["w13"], wt["w2"], wt["w13_scale"], wt["w2_scale"], self.fmt,
                BETA, LIN_BETA)

    def fused(self, i, config=None):
        s = self.sets[i]
        out = torch.empty(self.m, HIDDEN, device="cuda", dtype=DT)
        y = run_experts(*self.routed_args(s), rms_weight=self.rms, eps=EPS,
                        shared=SharedExpert(s["x"], *self.sh, out), config=config)
        return y, out

    def routed_only(self, i, config=None):
        return run_experts(*self.routed_args(self.sets[i]), config=config)

    def unfused_lmf(self, i, config=None):
        s = self.sets[i]
        y = run_experts(*self.routed_args(s), config=config)
        return stock_rms_norm(y, self.rms, EPS), stock_shared(s["x"], *self.sh, BETA, LIN_BETA)

    def reference(self, i):
        if i not in self._refs:
            s = self.sets[i]
            y = routed_experts_math(*self.routed_args(s))
            self._refs[i] = (rms_norm_math(y, self.rms, EPS), shared_expert_math(s["x"], *self.sh, BETA, LIN_BETA))
        return self._refs[i]

    def hit_experts(self) -> float:
        return sum(int(torch.unique(s["ids"][s["ids"] >= 0]).numel()) for s in self.sets) / len(self.sets)

    def pairs(self) -> float:
        return sum(int((s["ids"] >= 0).sum()) for s in self.sets) / len(self.sets)


class StockCase:
    """The unfused stock sequence on BF16 weights (grouped_mm + torch shared MLP + F.rms_norm)."""

    def __init__(self, case: Case, bf16_weights):
        self.c, self.wt = case, bf16_weights

    def routed(self, i):
        s = self.c.sets[i]
        return stock_routed(s["z"], s["ids"], s["w"], self.wt["w13"], self.wt["w2"], BETA, LIN_BETA)

    def unfused(self, i):
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


def graph_us(fn, n_sets) -> float:
    return time_graph_ms(fn, n_sets) * 1e3


def sweep(cases: dict, log) -> dict:
    """Time each candidate config on the fused producer; returns {(phase, fmt): name} and rows."""
    best, rows = {}, []
    plan = [("decode", fmt, (32,), decode_candidates(fmt)) for fmt in ("bf16", "mxfp4")]
    plan += [("prefill", fmt, (4096,), prefill_candidates(fmt)) for fmt in ("bf16", "mxfp4")]
    for phase, fmt, ms, cands in plan:
        totals = {}
        for name, cfg in cands.items():
            total = 0.0
            for m in ms:
                case = cases[(m, fmt)]
                try:
                    us = graph_us(lambda i, c=case, g=cfg: c.fused(i, g), len(case.sets))
                    y, s = case.fused(0, cfg)
                    ry, rs = case.reference(0)
                    err = max(rel_l2(y, ry), rel_l2(s, rs))
                except Exception as exc:  # a variant that does not compile is reported, not fatal
                    log(f"sweep {phase} {fmt} {name} M={m}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    us, err = float("inf"), float("nan")
                rows.append(dict(phase=phase, fmt=fmt, config=name, M=m, fused_us=us, err=err))
                log(f"sweep {phase} {fmt} {name} M={m}: {us:.1f} us err {err:.2e}")
                total += us if err < 1e-2 else float("inf")
            totals[name] = total
        best[(phase, fmt)] = min(totals, key=totals.get)
        log(f"best {phase} {fmt}: {best[(phase, fmt)]}")
    return {"best": {f"{k[0]}/{k[1]}": v for k, v in best.items()}, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--sweep", action="store_true", help="time candidate tile configs first and use the best")
    ap.add_argument("--quick", action="store_true", help="decode M = 1, 32 and prefill 512 only")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "producer_log.txt"
    log_path.write_text("")

    def log(msg):
        print(msg, flush=True)
        with log_path.open("a") as f:
            f.write(msg + "\n")

    meta = environment()
    ceil = measure_ceilings()
    bw, rate = ceil["copy_bytes_per_s"], ceil["bf16_flop_per_s"]
    meta.update(copy_TBps=round(bw / 1e12, 3), bf16_TFLOPs=round(rate / 1e12, 1), grouped_mm=has_grouped_mm(),
                config=f"E_local={LOCAL_EXPERTS}/{GLOBAL_EXPERTS} top{TOP_K} I={INTER} L={LATENT} H={HIDDEN} "
                       f"I_s={INTER_S}, routing of {EP}x global tokens")
    log(f"ceilings: copy {bw / 1e12:.2f} TB/s, bf16 {rate / 1e12:.0f} TFLOP/s")

    gen = torch.Generator().manual_seed(1234)
    weights = {fmt: make_weights(fmt, gen) for fmt in ("bf16", "mxfp4")}
    shared_w = make_shared_weights()
    rms_w = make_rms_weight()
    decode_m = (1, 32) if args.quick else DECODE_M
    prefill_m = (512,) if args.quick else PREFILL_M
    cases = {}
    for m in decode_m + prefill_m + ((32, 4096) if args.sweep else ()):
        if any(k[0] == m for k in cases):
            continue
        sets = make_sets(m, 4 if m <= 128 else 2, gen)
        for fmt in ("bf16", "mxfp4"):
            cases[(m, fmt)] = Case(m, fmt, weights[fmt], shared_w, rms_w, sets)

    sweep_result = sweep(cases, log) if args.sweep else None
    chosen = {}
    if sweep_result:
        for key, name in sweep_result["best"].items():
            phase, fmt = key.split("/")
            cands = decode_candidates(fmt) if phase == "decode" else prefill_candidates(fmt)
            chosen[(phase, fmt)] = cands[name]

    rows: list[dict] = []
    if sweep_result:
        meta["sweep_best"] = sweep_result["best"]
        (out_dir / "producer_sweep.json").write_text(json.dumps(sweep_result, indent=2) + "\n")
    meta["chosen_configs"] = {f"{k[0]}/{k[1]}": asdict(v) for k, v in chosen.items()}
    for m in decode_m + prefill_m:
        phase = "decode" if m in DECODE_M else "prefill"
        stock = _measure_stock(cases[(m, "bf16")], weights["bf16"], log)
        for fmt in ("bf16", "mxfp4"):
            cfg = pick_config(m * TOP_K, fmt, DT, LOCAL_EXPERTS)
            if (phase, fmt) in chosen:  # the sweep's tiles, with the block rows the batch needs
                cfg = replace(chosen[(phase, fmt)], bm=cfg.bm)
            try:
                row = _measure_row(cases[(m, fmt)], phase, cfg, stock, bw, rate)
            except Exception as exc:  # keep the other rows
                log(f"M={m} {fmt}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
                continue
            rows.append(row)
            log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        _write(rows, meta, out_dir)
    _plot(rows, out_dir / "producer.png")


COLUMNS = ["phase", "M", "format", "experts_hit", "config", "fused_us", "unfused_stock_us", "unfused_lmf_us",
           "grouped_mm_us", "routed_triton_us", "floor_us", "fused_over_floor", "speedup_vs_stock",
           "speedup_vs_lmf_unfused", "mxfp4_speedup_vs_bf16", "routed_TFLOPs", "fused_err", "stock_err"]
NOTES = ("unfused_stock: torch._grouped_mm on BF16 weights (also for the mxfp4 rows: no stock MXFP4 grouped GEMM "
         "on Hopper) + shared MLP in torch + F.rms_norm; grouped_mm: its routed part alone. unfused_lmf: the lmf "
         "Triton routed op + torch shared MLP + F.rms_norm. Times: CUDA graph replay, us per call, rotating input "
         "sets. floor: bytes moved once (weights of the experts hit + shared weights + activations) / copy BW.")


def _write(rows: list[dict], meta: dict, out_dir: Path) -> None:
    for row in rows:
        bf = next((r for r in rows if r["M"] == row["M"] and r["format"] == "bf16"), None)
        if row["format"] == "mxfp4" and bf is not None:
            row["mxfp4_speedup_vs_bf16"] = bf["fused_us"] / row["fused_us"]
    write_results("producer", rows, COLUMNS, meta, out_dir, NOTES)


def _measure_stock(case: Case, bf16_weights, log) -> dict:
    nan = float("nan")
    if not has_grouped_mm():
        return dict(unfused_us=nan, routed_us=nan, err=nan)
    try:
        stock = StockCase(case, bf16_weights)
        n_sets = len(case.sets)
        sy, ss = stock.unfused(0)
        ry, rs = case.reference(0)
        return dict(unfused_us=graph_us(stock.unfused, n_sets), routed_us=graph_us(stock.routed, n_sets),
                    err=max(rel_l2(sy, ry), rel_l2(ss, rs)))
    except Exception as exc:
        log(f"stock M={case.m}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
        return dict(unfused_us=nan, routed_us=nan, err=nan)


def _measure_row(case: Case, phase: str, cfg: ProducerConfig, stock: dict, bw: float, rate: float) -> dict:
    m, fmt, n_sets = case.m, case.fmt, len(case.sets)
    y, s = case.fused(0, cfg)
    ry, rs = case.reference(0)
    err = max(rel_l2(y, ry), rel_l2(s, rs))
    y2, s2 = case.fused(0, cfg)
    fused_us = graph_us(lambda i: case.fused(i, cfg), n_sets)
    lmf_unfused_us = graph_us(lambda i: case.unfused_lmf(i, cfg), n_sets)
    routed_us = graph_us(lambda i: case.routed_only(i, cfg), n_sets)
    hit, pairs = case.hit_experts(), case.pairs()
    floor = floor_us(case, bw)
    routed_flops = 2 * pairs * 3 * INTER * LATENT
    row = dict(
        phase=phase, M=m, format=fmt, experts_hit=round(hit, 1), pairs=round(pairs, 1),
        config=config_name(cfg),
        fused_us=fused_us, unfused_stock_us=stock["unfused_us"], unfused_lmf_us=lmf_unfused_us,
        grouped_mm_us=stock["routed_us"], routed_triton_us=routed_us, floor_us=floor,
        fused_over_floor=fused_us / floor, speedup_vs_stock=stock["unfused_us"] / fused_us,
        speedup_vs_lmf_unfused=lmf_unfused_us / fused_us,
        routed_TFLOPs=routed_flops / (routed_us * 1e-6) / 1e12,
        fused_err=err, stock_err=stock["err"], deterministic=bool(torch.equal(y, y2) and torch.equal(s, s2)),
    )
    if phase == "prefill":
        # GEMM-only time: the routed op minus its grouping and combine launches.
        grp = graph_us(lambda i: _group_and_combine(case, i, cfg), n_sets)
        row["routed_gemm_us"] = routed_us - grp
        row["routed_gemm_TFLOPs"] = routed_flops / ((routed_us - grp) * 1e-6) / 1e12
        row["gemm_frac_of_bf16_peak"] = row["routed_gemm_TFLOPs"] * 1e12 / rate
    return row


def _group_and_combine(case: Case, i: int, cfg: ProducerConfig):
    s = case.sets[i]
    group_by_expert(s["ids"], LOCAL_EXPERTS, cfg.bm)
    pairs = torch.empty(s["ids"].numel(), LATENT, device="cuda", dtype=torch.float32)
    launch_combine(pairs, s["ids"], s["w"], torch.empty_like(s["z"]), None, 0.0)


def _plot(rows, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, fmt in zip(axes, ("bf16", "mxfp4"), strict=True):
        sel = [r for r in rows if r["format"] == fmt]
        xs = range(len(sel))
        width = 0.2
        for k, (key, label) in enumerate([("floor_us", "HBM floor"), ("fused_us", "fused (Triton)"),
                                          ("unfused_lmf_us", "unfused, lmf routed"),
                                          ("unfused_stock_us", "unfused stock (grouped_mm bf16)")]):
            ax.bar([x + (k - 1.5) * width for x in xs], [r[key] for r in sel], width, label=label)
        ax.set_xticks(list(xs), [f"{r['phase'][0]} M={r['M']}" for r in sel])
        ax.set_yscale("log")
        ax.set_ylabel("us per call (CUDA graph)")
        ax.set_title(f"producer, routed weights {fmt}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
