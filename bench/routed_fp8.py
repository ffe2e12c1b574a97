"""The routed experts on FP8 MMAs (ops/routed/gluon/routed_fp8.py; the L1's default at decode where the grouping takes
16-row blocks) against the bf16 register-dequant kernels.

Inputs: bench/routed_inputs.py's decode cases (the Kimi K3 rank's share at decode, one token per row, 4 rotating sets):
each L1 alone, replayed from one CUDA graph, against the L1 byte floor (MXFP4 bytes of the experts hit / copy
bandwidth), and the activation split (ops/routed/fp8_split.py: per token, before L1) timed alone. Accuracy: the act rows
of both kernels against a float64 reference (weights dequantised exactly, the tokens' bf16 values), and against
each other; every valid row must be written (outputs poisoned with NaN first). A second table (<name>_layers): the L2
kernels on the FP8 path's 8-row blocks, and the whole routed op with L1, or L1 and L2, on FP8.

    PYTHONPATH=. python3 bench/routed_fp8.py --out DIR [--m 8 32 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import env_applied, environment, measure_ceilings, rel_l2, time_graph_ms, write_results  # noqa: E402
from bench.producer import BETA, INTER, LATENT, LIN_BETA, LOCAL_EXPERTS, TOP_K  # noqa: E402
from bench.routed_inputs import decode_cases  # noqa: E402
from latent_moe_fusion.ops.common.mxfp4 import dequantize_mxfp4  # noqa: E402
from latent_moe_fusion.ops.routed.fp8_split import split_e4m3  # noqa: E402
from latent_moe_fusion.ops.routed.gluon import (  # noqa: E402
    launch_routed_l1,
    launch_routed_l1_fp8,
    launch_routed_l2,
    launch_routed_l2_fp8,
)
from latent_moe_fusion.ops.routed.producer_config import ROUTED_FP8_ENV  # noqa: E402
from latent_moe_fusion.ops.routed.triton.fp8_split_kernel import launch_split_e4m3  # noqa: E402
from latent_moe_fusion.ops.routed.triton.moe_align import group_by_expert  # noqa: E402

COLUMNS = ["M", "bm", "variant", "experts_hit", "l1_floor_us", "bf16_l1_us", "fp8_l1_us", "split_us", "fp8_vs_bf16",
           "bf16_x_floor", "fp8_x_floor", "fp8_with_split_x_floor", "bf16_err64", "fp8_err64", "fp8_vs_bf16_err",
           "split_bitwise"]
LAYER_COLUMNS = ["M", "experts_hit", "l2_floor_us", "l2_bf16_us", "act_split_us", "l2_fp8_us", "l2_fp8_vs_bf16",
                 "l2_bf16_x_floor", "l2_fp8_x_floor", "l2_fp8_with_split_x_floor", "l2_fp8_vs_bf16_err",
                 "routed_bf16_us", "routed_fp8_l1_us", "routed_fp8_us", "routed_fp8_l1_vs_bf16", "routed_fp8_vs_bf16",
                 "routed_bf16_err", "routed_fp8_l1_err", "routed_fp8_err"]
ROUTED_FLAGS = {"bf16": "0", "fp8_l1": "1", "fp8": "l1,l2"}  # LMF_ROUTED_FP8 values
NOTES = ("bf16_l1: the register-dequant L1 on the TMA ring (the default at these M); fp8_l1: the FP8 L1 "
         "(e2m1 codes as e4m3, activations split per token in two e4m3 parts, scales on the FP32 sums of each "
         "32-block; variant: its MMA schedule, fp8_mainloop._step_mmas, block rows after a comma, a register cap after a colon); split: the "
         "split kernel (triton_kernels/fp8_split.py) alone, split_bitwise: it equals ops.fp8_split.split_e4m3 bit for "
         "bit; *_err64: relative L2 error of the valid act "
         "rows against float64; times: medians over alternating rounds, each the CUDA-graph replay of one L1 per "
         "input set")
LAYER_NOTES = ("8-row blocks (the FP8 path's grouping), act from the FP8 L1: l2_bf16: the bf16 register-dequant L2 "
               "(TMA ring); act_split: L1's act rows split in two e4m3 parts (triton_kernels/fp8_split.py, rows that "
               "hold a pair); l2_fp8: the FP8 L2 (routed_fp8.py) on them; l2_fp8_vs_bf16_err: relative L2 distance of "
               "their FP32 pair rows; routed_*: the whole routed op (run_experts as picked, in one CUDA graph per "
               "input set) with LMF_ROUTED_FP8 = 0 (bf16 kernels), 1 (FP8 L1, bf16 L2: routed_fp8_l1) and l1,l2 (both FP8: routed_fp8), *_err "
               "against the FP32 reference of bench/routed_inputs.py; medians over alternating rounds")


def _situ64(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (BETA * torch.tanh(g / BETA) * torch.sigmoid(g)) * (LIN_BETA * torch.tanh(u / LIN_BETA))


def act_reference(z, w13, w13_scale, sorted_pairs, block_expert, bm) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid rows, their act in float64): SiTU of the float64 gate and up sums of each row's token."""
    rows = torch.nonzero(sorted_pairs >= 0).flatten()
    tok = (sorted_pairs[rows] // TOP_K).long()
    expert = block_expert[rows // bm].long()
    ref = torch.empty(rows.numel(), INTER, dtype=torch.float64, device=z.device)
    for e in torch.unique(expert).tolist():
        sel = expert == e
        w = dequantize_mxfp4(w13[e], w13_scale[e], torch.float64)
        h = z[tok[sel]].double() @ w.T
        ref[sel] = _situ64(h[:, :INTER], h[:, INTER:])
    return rows, ref


def _variant(text: str) -> tuple[str, int | None, int | None]:
    """"mma[,block rows][:maxnreg]" -> (mma, block rows or None: the bf16 kernel's, register cap or None)."""
    head, _, cap = text.partition(":")
    mma, _, rows = head.partition(",")
    return mma, int(rows) if rows else None, int(cap) if cap else None


def _rows_in_order(sorted_pairs: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """The rows of sorted_pairs that hold each of pairs (every pair appears once)."""
    where = torch.full((int(sorted_pairs.max()) + 1,), -1, dtype=torch.long, device=sorted_pairs.device)
    rows = torch.nonzero(sorted_pairs >= 0).flatten()
    where[sorted_pairs[rows].long()] = rows
    return where[pairs.long()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", nargs="+", default=["pipe"],
                    help="FP8 L1 variants: schedule (fp8_mainloop._step_mmas: pipe, block), optionally ,block rows "
                    "(8, 16, 32; default: the bf16 kernel's) and :maxnreg, e.g. pipe,8 or pipe,16:128")
    ap.add_argument("--name", default="routed_fp8")
    args = ap.parse_args()
    if "pipe,8" not in args.variants:
        args.variants.append("pipe,8")  # the FP8 path's L1: its act feeds the L2 comparison
    bw = measure_ceilings()["copy_bytes_per_s"]
    rows, layer_rows = [], []
    for dc in decode_cases(args.m, 23, bw):
        if dc.routing != "1 token/row" or dc.m not in args.m:
            continue
        case, bm = dc.case, dc.picked.bm
        wt = case.wt
        w13, w13s = wt["w13"], wt["w13_scale"]
        groupings = [group_by_expert(s["ids"], LOCAL_EXPERTS, bm) for s in case.sets]
        nb = groupings[0].block_expert.numel()
        acts_b = [torch.full((nb * bm, INTER), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in case.sets]
        fp8_bms = sorted({_variant(v)[1] or bm for v in args.variants})
        fp8_groups = {b: [group_by_expert(s["ids"], LOCAL_EXPERTS, b) for s in case.sets] for b in fp8_bms}
        acts_f = {b: [torch.full((g[0].block_expert.numel() * b, INTER), float("nan"), dtype=torch.bfloat16,
                                 device="cuda") for _ in case.sets] for b, g in fp8_groups.items()}
        splits = [launch_split_e4m3(s["z"]) for s in case.sets]

        def bf16_l1(i: int) -> None:
            g = groupings[i]
            launch_routed_l1(case.sets[i]["z"], w13, w13s, g.sorted_pairs, g.block_expert, acts_b[i], nb, bm, TOP_K,
                             BETA, LIN_BETA, ring="tma")

        def fp8_l1(i: int, variant: str) -> None:
            mma, fbm, cap = _variant(variant)
            fbm = fbm or bm
            g = fp8_groups[fbm][i]
            launch_routed_l1_fp8(*splits[i], w13, w13s, g.sorted_pairs, g.block_expert, acts_f[fbm][i],
                                 g.block_expert.numel(), fbm, TOP_K, BETA, LIN_BETA, mma=mma, maxnreg=cap)

        def split(i: int) -> None:
            launch_split_e4m3(case.sets[i]["z"])

        # The split kernel against its torch form: bitwise.
        split_same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                         for s in case.sets for a, b in zip(launch_split_e4m3(s["z"]), split_e4m3(s["z"]), strict=True))
        w2, w2s = wt["w2"], wt["w2_scale"]
        g8, a8 = fp8_groups[8], acts_f[8]
        nb8 = g8[0].block_expert.numel()
        pairs_b = [torch.full((dc.m * TOP_K, LATENT), float("nan"), device="cuda") for _ in case.sets]
        pairs_f = [torch.full_like(p, float("nan")) for p in pairs_b]
        for i in range(len(case.sets)):
            bf16_l1(i)
            fp8_l1(i, "pipe,8")
        parts8 = [launch_split_e4m3(a8[i][: nb8 * 8], g8[i].sorted_pairs) for i in range(len(case.sets))]

        def l2_bf16(i: int) -> None:
            launch_routed_l2(a8[i], w2, w2s, g8[i].sorted_pairs, g8[i].block_expert, pairs_b[i], nb8, 8)

        def act_split(i: int) -> None:
            launch_split_e4m3(a8[i][: nb8 * 8], g8[i].sorted_pairs)

        def l2_fp8(i: int) -> None:
            launch_routed_l2_fp8(*parts8[i], w2, w2s, g8[i].sorted_pairs, g8[i].block_expert, pairs_f[i], nb8, 8)

        for i in range(len(case.sets)):
            l2_bf16(i)
            l2_fp8(i)
        torch.cuda.synchronize()
        live = case.sets[0]["ids"].flatten() >= 0
        l2_err = rel_l2(pairs_f[0][live], pairs_b[0][live].double())
        g0 = groupings[0]
        valid, ref = act_reference(case.sets[0]["z"], w13, w13s, g0.sorted_pairs, g0.block_expert, bm)
        err_b = rel_l2(acts_b[0][valid], ref)
        steps = {"bf16": bf16_l1, "split": split, "l2_bf16": l2_bf16, "act_split": act_split, "l2_fp8": l2_fp8}
        for variant in args.variants:
            steps[variant] = lambda i, v=variant: fp8_l1(i, v)
        times: dict[str, list[float]] = {name: [] for name in (*steps, *(f"routed_{r}" for r in ROUTED_FLAGS))}
        for _ in range(args.rounds):
            for name, step in steps.items():
                times[name].append(time_graph_ms(step, len(case.sets)) * 1e3)
            for name, flag in ROUTED_FLAGS.items():  # the whole routed op, as picked
                with env_applied({ROUTED_FP8_ENV: flag}):
                    times[f"routed_{name}"].append(time_graph_ms(case.routed_only, len(case.sets)) * 1e3)
        routed = {}
        for name, flag in ROUTED_FLAGS.items():
            with env_applied({ROUTED_FP8_ENV: flag}):
                routed[name] = case.routed_only(0)
        t = {k: statistics.median(v) for k, v in times.items()}
        for variant in args.variants:
            fbm = _variant(variant)[1] or bm
            for a in acts_f[fbm]:
                a.fill_(float("nan"))
            for i in range(len(case.sets)):
                fp8_l1(i, variant)
            torch.cuda.synchronize()
            gf = fp8_groups[fbm][0]
            # The same (token, slot) pairs in the FP8 kernel's own blocks: its rows in the bf16 rows' order.
            f_rows = _rows_in_order(gf.sorted_pairs, g0.sorted_pairs[valid])
            row = {"M": dc.m, "bm": bm, "variant": variant, "experts_hit": dc.hit, "l1_floor_us": dc.l1_floor_us,
                   "bf16_l1_us": t["bf16"], "fp8_l1_us": t[variant], "split_us": t["split"],
                   "fp8_vs_bf16": t["bf16"] / t[variant], "bf16_x_floor": t["bf16"] / dc.l1_floor_us,
                   "fp8_x_floor": t[variant] / dc.l1_floor_us,
                   "fp8_with_split_x_floor": (t[variant] + t["split"]) / dc.l1_floor_us, "bf16_err64": err_b,
                   "fp8_err64": rel_l2(acts_f[fbm][0][f_rows], ref),
                   "fp8_vs_bf16_err": rel_l2(acts_f[fbm][0][f_rows], acts_b[0][valid].double()),
                   "split_bitwise": split_same}
            print(row, flush=True)
            rows.append(row)
        layer = {"M": dc.m, "experts_hit": dc.hit, "l2_floor_us": dc.l2_floor_us, "l2_bf16_us": t["l2_bf16"],
                 "act_split_us": t["act_split"], "l2_fp8_us": t["l2_fp8"], "l2_fp8_vs_bf16": t["l2_bf16"] / t["l2_fp8"],
                 "l2_bf16_x_floor": t["l2_bf16"] / dc.l2_floor_us, "l2_fp8_x_floor": t["l2_fp8"] / dc.l2_floor_us,
                 "l2_fp8_with_split_x_floor": (t["l2_fp8"] + t["act_split"]) / dc.l2_floor_us,
                 "l2_fp8_vs_bf16_err": l2_err}
        for name in ROUTED_FLAGS:
            layer[f"routed_{name}_us"] = t[f"routed_{name}"]
            layer[f"routed_{name}_err"] = rel_l2(routed[name], dc.ref)
            if name != "bf16":
                layer[f"routed_{name}_vs_bf16"] = t["routed_bf16"] / t[f"routed_{name}"]
        print(layer, flush=True)
        layer_rows.append(layer)
    meta = environment() | {"copy_TBps": bw / 1e12, "routing": "1 token/row (bench/routed_inputs.py)"}
    write_results(args.name, rows, COLUMNS, meta, args.out, NOTES)
    write_results(f"{args.name}_layers", layer_rows, LAYER_COLUMNS, meta, args.out, LAYER_NOTES)


if __name__ == "__main__":
    main()
