"""Routed experts on one H200: DeepGEMM's SM90 BF16 grouped GEMMs vs the Triton routed backend.

Configuration of the producer issue: one rank of Kimi K3 at EP8, 112 local experts of 896, top-16
over all 896 (ids of other ranks' experts become -1, so about 2 of the 16 land here), I = 3072,
L = 3584, MXFP4 weights. DeepGEMM's grouped GEMMs take BF16 weights only, so its backend reads a
BF16 copy made once (4x the bytes of MXFP4); both floors are in the table. Decode sizes are timed
as CUDA-graph replays over rotating input sets, prefill with CUDA events (medians).

    PYTHONPATH=. python3 bench/deepgemm_routed.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, measure_ceilings, rel_l2, time_graph_ms, time_ms, write_results  # noqa: E402
from bench.kernel_breakdown import breakdown_markdown, kernel_times_us  # noqa: E402
from latent_moe_fusion import tuning  # noqa: E402
from latent_moe_fusion.model.router import localize_ids  # noqa: E402
from latent_moe_fusion.ops.common.backends import backends_for  # noqa: E402
from latent_moe_fusion.ops.common.mxfp4 import quantize_mxfp4  # noqa: E402
from latent_moe_fusion.ops.common.reference_math import routed_experts_math  # noqa: E402
from latent_moe_fusion.ops.routed.deepgemm import deepgemm_status, probe_deepgemm  # noqa: E402
from latent_moe_fusion.ops.routed.deepgemm.probe import SM90_GROUPED, deep_gemm_module  # noqa: E402
from latent_moe_fusion.ops.routed.deepgemm.sm90_grouped import (  # noqa: E402
    LAYOUTS,
    bf16_weights,
    choose_layout,
    contiguous_gemms,
    masked_gemms,
    plan_routing,
    routed_deepgemm,
    stage_contiguous,
    stage_masked,
)

DECODE_M = (1, 8, 32, 128)
PREFILL_M = (512, 4096)
LOCAL_EXPERTS, TOTAL_EXPERTS, TOP_K, INTER, LATENT = 112, 896, 16, 3072, 3584
BETA, LIN_BETA = 4.0, 25.0


def make_weights(weight_format: str, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.empty(LOCAL_EXPERTS, 2 * INTER, LATENT, dtype=torch.bfloat16, device="cuda")
    w2 = torch.empty(LOCAL_EXPERTS, LATENT, INTER, dtype=torch.bfloat16, device="cuda")
    for e in range(LOCAL_EXPERTS):  # per expert: quantizing all at once needs tens of GB of temporaries
        w13[e].normal_(0, LATENT**-0.5, generator=gen)
        w2[e].normal_(0, INTER**-0.5, generator=gen)
    if weight_format == "bf16":
        return w13, w2, None, None
    q13 = torch.empty(LOCAL_EXPERTS, 2 * INTER, LATENT // 2, dtype=torch.uint8, device="cuda")
    s13 = torch.empty(LOCAL_EXPERTS, 2 * INTER, LATENT // 32, dtype=torch.uint8, device="cuda")
    q2 = torch.empty(LOCAL_EXPERTS, LATENT, INTER // 2, dtype=torch.uint8, device="cuda")
    s2 = torch.empty(LOCAL_EXPERTS, LATENT, INTER // 32, dtype=torch.uint8, device="cuda")
    for e in range(LOCAL_EXPERTS):
        q13[e], s13[e] = quantize_mxfp4(w13[e])
        q2[e], s2[e] = quantize_mxfp4(w2[e])
    del w13, w2
    torch.cuda.empty_cache()
    return q13, q2, s13, s2


def make_inputs(m: int, num_sets: int):
    sets = []
    for _ in range(num_sets):
        z = torch.randn(m, LATENT, device="cuda", dtype=torch.bfloat16)
        scores = torch.rand(m, TOTAL_EXPERTS, device="cuda")
        top = scores.topk(TOP_K, dim=-1)
        ids = localize_ids(top.indices.to(torch.int32), 0, LOCAL_EXPERTS)
        w = top.values / top.values.sum(dim=-1, keepdim=True)
        sets.append((z, ids, w.float()))
    return sets


def floors(ids: torch.Tensor, weight_format: str, ceilings: dict) -> dict:
    hit = int(torch.unique(ids[ids >= 0]).numel())
    assignments = int((ids >= 0).sum())
    per_expert_mxfp4 = 3 * INTER * LATENT // 2 + 3 * INTER * LATENT // 32
    per_expert_bf16 = 3 * INTER * LATENT * 2
    act = ids.shape[0] * LATENT * 2 * 2
    flops = 2 * assignments * 3 * INTER * LATENT
    flop_us = flops / ceilings["bf16_flop_per_s"] * 1e6
    stored = per_expert_mxfp4 if weight_format == "mxfp4" else per_expert_bf16
    return {
        "hit": hit,
        "assignments": assignments,
        "floor_us": max((hit * stored + act) / ceilings["copy_bytes_per_s"] * 1e6, flop_us),
        "floor_bf16_copy_us": max((hit * per_expert_bf16 + act) / ceilings["copy_bytes_per_s"] * 1e6, flop_us),
    }


def gemms_only(sets, w13_bf16, w2_bf16, layout: str):
    """The two grouped GEMMs (and the SiTU between them) on inputs staged beforehand: what DeepGEMM's
    kernels cost without our routing glue (plan, scatter into groups, weighted combine)."""
    dg = deep_gemm_module()
    staged = []
    for z, ids, w in sets:
        plan = plan_routing(ids, w, LOCAL_EXPERTS)
        if layout == "masked":
            a, _, expected_m = stage_masked(z, plan, LOCAL_EXPERTS)
            staged.append(lambda a=a, c=plan.counts, e=expected_m: masked_gemms(
                a, c, e, w13_bf16, w2_bf16, BETA, LIN_BETA, dg))
        else:
            a, layout_t, _ = stage_contiguous(z, plan, LOCAL_EXPERTS, int(dg.get_mk_alignment_for_contiguous_layout()))
            staged.append(lambda a=a, t=layout_t: contiguous_gemms(a, t, w13_bf16, w2_bf16, BETA, LIN_BETA, dg))
    return staged


def triton_backend(args):
    for b in backends_for("routed_experts"):
        if b.name == "triton":
            reason = b.available() or b.supports(*args)
            return (b.fn, None) if reason is None else (None, reason)
    return None, "no Triton routed backend registered"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=list(DECODE_M + PREFILL_M))
    ap.add_argument("--weight-format", choices=("mxfp4", "bf16"), default="mxfp4")
    ap.add_argument("--no-check", action="store_true", help="skip the comparison with the reference op")
    ap.add_argument("--no-kernels", action="store_true", help="skip the per-kernel time breakdown")
    ap.add_argument("--layout", choices=LAYOUTS, help="force this layout (the deepgemm_routed_layout tuning override; "
                                                      "default: by M)")
    args = ap.parse_args()
    with tuning.overrides(deepgemm_routed_layout=args.layout):
        run(args)


def run(args: argparse.Namespace) -> None:
    if not probe_deepgemm().has(SM90_GROUPED):
        raise SystemExit(f"DeepGEMM SM90 grouped GEMMs unavailable: {deepgemm_status()}")
    torch.manual_seed(0)
    ceilings = measure_ceilings()
    w13, w2, s13, s2 = make_weights(args.weight_format)
    weight_args = (w13, w2, s13, s2, args.weight_format, BETA, LIN_BETA)
    w13_bf16, w2_bf16 = bf16_weights(w13, w2, s13, s2, args.weight_format)  # one-time BF16 copy, untimed
    rows = []
    kernels = {}
    for m in args.m:
        num_sets = 4 if m <= 128 else 2
        sets = make_inputs(m, num_sets)
        row = {"M": m, "layout": choose_layout(m)} | floors(sets[0][1], args.weight_format, ceilings)
        variants = {"deepgemm": routed_deepgemm}
        tri, why = triton_backend(sets[0] + weight_args)
        if tri is not None:
            variants["triton"] = tri
        else:
            row["triton_note"] = why
        ref = None if args.no_check else routed_experts_math(*sets[0], *weight_args)
        for name, fn in variants.items():
            out = fn(*sets[0], *weight_args)
            if ref is not None:
                row[f"{name}_err"] = rel_l2(out, ref)
            if m <= 128:
                row[f"{name}_us"] = time_graph_ms(lambda i, fn=fn: fn(*sets[i], *weight_args), num_sets) * 1e3
            else:
                row[f"{name}_us"] = time_ms(lambda fn=fn: fn(*sets[0], *weight_args), warmup=3, iters=10) * 1e3
        staged = gemms_only(sets, w13_bf16, w2_bf16, row["layout"])
        if m <= 128:
            row["deepgemm_gemms_us"] = time_graph_ms(lambda i: staged[i](), num_sets) * 1e3
        else:
            row["deepgemm_gemms_us"] = time_ms(staged[0], warmup=3, iters=10) * 1e3
        if not args.no_kernels:
            for name, fn in variants.items():
                kernels[f"M = {m}, {name}"] = kernel_times_us(lambda fn=fn: fn(*sets[0], *weight_args), top=6)
        if "triton_us" in row:
            row["deepgemm_vs_triton"] = row["triton_us"] / row["deepgemm_us"]
        row["deepgemm_x_floor"] = row["deepgemm_us"] / row["floor_us"]
        rows.append(row)
        print(row, flush=True)
    meta = environment() | {
        "config": f"one rank of Kimi K3 EP8: {LOCAL_EXPERTS}/{TOTAL_EXPERTS} experts, top-{TOP_K}, I={INTER}, "
                  f"L={LATENT}, weights {args.weight_format} (DeepGEMM reads a BF16 copy)",
        "deepgemm": deepgemm_status(),
        "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
        "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
        "timing": "M<=128: CUDA graph replay over rotating input sets, median; larger M: CUDA events, median",
        "layout": args.layout or "by M (masked <= 128 < contiguous)",
    }
    cols = ["M", "hit", "layout", "triton_us", "deepgemm_us", "deepgemm_gemms_us", "deepgemm_vs_triton", "floor_us", "floor_bf16_copy_us",
            "deepgemm_x_floor", "triton_err", "deepgemm_err"]
    write_results(f"deepgemm_routed_{args.weight_format}", rows, cols, meta, args.out,
                  notes="floor_us: the stored weights of the experts hit, read once (or the FLOPs at the measured "
                        "BF16 rate, if larger); floor_bf16_copy_us: the same with the BF16 copy DeepGEMM reads. "
                        "deepgemm_gemms_us: the two grouped GEMMs + SiTU alone on pre-staged inputs (no routing "
                        "plan, scatter or combine). err: relative L2 error against the reference op.")
    if kernels:
        (Path(args.out) / f"deepgemm_routed_{args.weight_format}_kernels.md").write_text(
            f"# routed experts ({args.weight_format}): CUDA kernel time per kernel (profiler, no CUDA graph)\n\n"
            + breakdown_markdown(kernels))


if __name__ == "__main__":
    main()
