"""Our routed experts side by side with what serving engines run on Hopper: OpenAI's triton_kernels MXFP4 MoE.

One EP8 rank of Kimi K3 (bench/peer_inputs.py): 112 of 896 MXFP4 experts, top-16 with the other ranks' experts at
-1 (about 2 local experts per token), L = 3584, I = 3072, SiTU (beta 4, lin_beta 25), z BF16. Rows, all on the same
bytes, z, ids and weights:
  ours             lmf::routed_experts, its default backend for the size;
  peer             triton_kernels v3.6.0 as vLLM sets it up on sm_90 (bench/peer_moe.py): our bytes in its Hopper
                   layouts (bench/peer_layout.py), routing data built per call (bench/peer_routing.py), L1 with gather
                   and SiTU through its FusedActivation hook (bench/peer_situ.py), L2 with scatter and the router
                   weights as gammas, its top-k reduce; expected_tokens_per_expt unset, as vLLM leaves it;
  peer+hint        the same with expected_tokens_per_expt = the mean local rows per expert of the timed sets;
  grouped_mm_bf16  torch._grouped_mm on BF16 copies of the weights (bench/peer_grouped_mm.py).
Times: one CUDA graph per row holding one call per rotating input set (each set routes to its own experts, so the
weights come from HBM: cold L2), replayed in alternating rounds (bench/common.time_graphs_interleaved_ms), median
per call. Errors: relative L2 against a float64 reference (weights dequantised exactly, nothing rounded), the largest
over the timed sets. Floor: the larger of (MXFP4 bytes of the experts hit + z + y + ids + weights) / measured copy
bandwidth and FLOPs (2 * 3 * I * L per local pair) / measured BF16 MMA rate, the mean over the timed sets.

    PYTHONPATH=. python bench/peer_routed.py --check              # correctness only, small M (first)
    PYTHONPATH=. python bench/peer_routed.py --out bench/results  # the timing table: peer_routed.{json,md}
    PYTHONPATH=. python bench/peer_routed.py --out /tmp/lmf --m 4096 --name peer_routed_4096  # a few M alone
    PYTHONPATH=. python bench/peer_routed.py --profile            # kernel by kernel: peer_routed_profile.{json,md}

Without the triton_kernels source (default .peer/python/triton_kernels, or --triton-kernels PATH) it says how to get
it and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    RESULTS_DIR,
    capture_graph,
    environment,
    measure_ceilings,
    rel_l2,
    sets_to_flush_l2,
    time_graphs_interleaved_ms,
    write_results,
)
from bench.peer_inputs import (  # noqa: E402
    BETA,
    GLOBAL_EXPERTS,
    INTER,
    LATENT,
    LIN_BETA,
    LOCAL_EXPERTS,
    TOP_K,
    RankInputs,
    floor_terms,
    floor_us,
    rank_inputs,
    rank_weights,
    routed_float64,
)
from bench.peer_layout import (  # noqa: E402
    DEFAULT_TRITON_KERNELS,
    HOPPER_SCALE_WARPS,
    HOW_TO_GET,
    source_fingerprint,
    use_triton_kernels,
)

DEFAULT_M = (1, 8, 32, 128, 4096, 8192, 16384, 32768)
CHECK_M = (1, 8, 32, 128)
PROFILE_M = (8, 4096)
CHECK_TOLERANCE = 1e-2  # relative L2 against float64 (BF16 activations: ~3e-3 expected) and between the two sides
VARIANTS = ("ours", "peer", "peer+hint", "grouped_mm_bf16")
SHAPE = (f"one EP8 rank of Kimi K3: {LOCAL_EXPERTS} of {GLOBAL_EXPERTS} experts MXFP4 (E8M0 per 32), top-{TOP_K} with "
         f"the other ranks' experts at -1, L={LATENT}, I={INTER}, SiTU beta={BETA} lin_beta={LIN_BETA}, z BF16")
PEER_SETUP = ("vLLM's sm_90 set-up: weights [E, K, N] quantised along K, HopperMXValueLayout(mx_axis=1), "
              f"HopperMXScaleLayout(mx_axis=1, num_warps={HOPPER_SCALE_WARPS}), opt flag split_k=1, gate/up rows "
              "interleaved, routing built per call (ids int16, weights BF16, bitmatrix, SparseMatrix, "
              "make_ragged_tensor_metadata), L1 matmul_ogs with gather + FusedActivation(SiTU), L2 with scatter and "
              "the router weights as gammas, top-k reduce; expected_tokens_per_expt unset (peer) or the mean local "
              "rows per expert (peer+hint)")
DIFFERENCES = (
    "Differences between the rows' work: (1) weights: the same MXFP4 bytes; the peer reads them in its Hopper "
    "swizzles (gate/up interleaved), ours in our layout, grouped_mm_bf16 reads BF16 copies (4x the bytes per expert). "
    "(2) skipped slots: ours skips ids < 0 in its grouping; the peer maps them to -1 when it packs the routing "
    "(no bit, sorted after every expert, masked in the top-k reduce) but still sizes L1's output and L2's scratch for "
    "all M*16 slots and its default tile choice counts them (M*16/112 rows per expert, 8x the local rows: "
    "peer+hint corrects that); grouped_mm_bf16 gathers all M*16 slot rows. (3) router weights: ours FP32; the peer "
    "rounds them to BF16 (vLLM's make_routing_data) and multiplies them in L2's epilogue. (4) L1: all accumulate "
    "in FP32; ours and the peer apply SiTU in FP32 to the accumulator (same formula and tanh) and round act to BF16; "
    "grouped_mm_bf16 rounds h to BF16 before SiTU. (5) top-k sum: ours sums the weighted FP32 L2 rows in FP32 and "
    "rounds once; the peer rounds each weighted (token, slot) row to BF16 into a [M*16, L] scratch, and its reduce "
    "reads all 16 slots of every token (skipped ones masked) and sums them in FP32; grouped_mm_bf16 rounds L2's "
    "output to BF16, then sums in FP32. Outputs: BF16 [M, L] for all.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS_DIR), help="results folder (default bench/results)")
    ap.add_argument("--m", type=int, nargs="+", default=None,
                    help=f"token counts (default {' '.join(map(str, DEFAULT_M))}; --check: {CHECK_M}; "
                         f"--profile: {PROFILE_M})")
    ap.add_argument("--triton-kernels", default=str(DEFAULT_TRITON_KERNELS),
                    help="the python/triton_kernels folder of a triton-lang/triton v3.6.0 checkout")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="correctness only at small M (no timing)")
    mode.add_argument("--profile", action="store_true",
                      help="torch.profiler kernel table of ours and the peer (peer_routed_profile.md)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="peer_routed",
                    help="results name of the timing table (a run of a few M under its own name)")
    args = ap.parse_args(argv)
    if args.m is not None and any(m < 1 for m in args.m):
        ap.error("--m values must be >= 1")
    return args


class Setup:
    """The rank's weights once, and every row's callable (z, ids, weights) -> y over them."""

    def __init__(self, seed: int) -> None:
        from bench.peer_grouped_mm import GroupedMMExperts
        from bench.peer_moe import PeerRoutedExperts

        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.w = rank_weights(self.gen, "cuda")
        w = self.w
        self.peer = PeerRoutedExperts(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], BETA, LIN_BETA)
        self.grouped = GroupedMMExperts(w["w13"], w["w13_scale"], w["w2"], w["w2_scale"], BETA, LIN_BETA)

    def ours(self, z: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        w = self.w
        return torch.ops.lmf.routed_experts(z, ids, weights, w["w13"], w["w2"], w["w13_scale"], w["w2_scale"],
                                            "mxfp4", BETA, LIN_BETA)

    def ours_backend(self, s: RankInputs) -> str:
        from latent_moe_fusion.ops import select_backend

        w = self.w
        return select_backend("routed_experts", "cuda", s.z, s.ids, s.weights, w["w13"], w["w2"], w["w13_scale"],
                              w["w2_scale"], "mxfp4", BETA, LIN_BETA).name

    def rows(self, hint: int) -> dict[str, Callable[..., torch.Tensor]]:
        return {"ours": self.ours, "peer": self.peer, "peer+hint": self.peer.with_hint(hint),
                "grouped_mm_bf16": self.grouped}

    def reference(self, s: RankInputs) -> torch.Tensor:
        w = self.w
        return routed_float64(s, w["w13"], w["w13_scale"], w["w2"], w["w2_scale"])


def mean_local_rows_per_expert(sets: list[RankInputs]) -> int:
    """The peer+hint value: local (token, expert) pairs per expert, mean over the sets, at least 1."""
    return max(1, round(sum(s.assignments() for s in sets) / len(sets) / LOCAL_EXPERTS))


def errors(setup: Setup, sets: list[RankInputs], fns: dict[str, Callable[..., torch.Tensor]]) -> dict[str, float]:
    """Largest relative L2 over the sets: each row against float64, and the peer against ours."""
    worst: dict[str, float] = {}
    for s in sets:
        if s.assignments() == 0:
            continue  # nothing routed here: every row returns zeros, no error to measure
        ref = setup.reference(s)
        outs = {name: fn(s.z, s.ids, s.weights) for name, fn in fns.items()}
        found = {f"{name}_err": rel_l2(out, ref) for name, out in outs.items()}
        found["peer_vs_ours_err"] = rel_l2(outs["peer"], outs["ours"])
        for key, value in found.items():
            worst[key] = max(worst.get(key, 0.0), value)
    return worst


def input_sets(setup: Setup, m: int) -> list[RankInputs]:
    """Rotating sets for one M: 4 at decode sizes, 2 beyond (as bench/block.py), more where a call moves too few
    bytes to push the last set's weights out of the 50 MB L2."""
    sets = [rank_inputs(m, setup.gen, "cuda") for _ in range(4 if m <= 128 else 2)]
    mean_bytes = sum(floor_terms(s)[0] for s in sets) / len(sets)
    while len(sets) < sets_to_flush_l2(int(mean_bytes)):
        sets.append(rank_inputs(m, setup.gen, "cuda"))
    return sets


def check(args: argparse.Namespace, setup: Setup) -> int:
    """Every row at small M against float64, the peer against ours, and each row replayed from a CUDA graph against
    its eager output (capture safety). 0 if all within CHECK_TOLERANCE."""
    failures = []
    print("| M | row | err vs float64 | graph replay vs eager | bitwise |\n|---|---|---|---|---|")
    for m in args.m or CHECK_M:
        sets = [rank_inputs(m, setup.gen, "cuda") for _ in range(3)]
        while not any(s.assignments() for s in sets):  # at M = 1 a token has no local expert 12 % of the time
            sets.append(rank_inputs(m, setup.gen, "cuda"))
        fns = setup.rows(mean_local_rows_per_expert(sets))
        errs = errors(setup, sets, fns)
        s = next((s for s in sets if s.assignments()), sets[0])
        for name, fn in fns.items():
            eager = fn(s.z, s.ids, s.weights)
            captured: dict[str, torch.Tensor] = {}
            graph = capture_graph(lambda i, fn=fn: captured.__setitem__("y", fn(s.z, s.ids, s.weights)), 1)
            graph.replay()
            torch.cuda.synchronize()
            replay_err = rel_l2(captured["y"], eager) if eager.abs().sum() else float(captured["y"].abs().sum())
            err = errs.get(f"{name}_err", 0.0)
            print(f"| {m} | {name} | {err:.3g} | {replay_err:.3g} | {torch.equal(captured['y'], eager)} |")
            if not err < CHECK_TOLERANCE or not replay_err < 1e-3:
                failures.append(f"M={m} {name}: err {err:.3g}, replay {replay_err:.3g}")
        peer_vs_ours = errs.get("peer_vs_ours_err", 0.0)
        print(f"| {m} | peer vs ours | {peer_vs_ours:.3g} | | |")
        if not peer_vs_ours < CHECK_TOLERANCE:
            failures.append(f"M={m} peer vs ours: {peer_vs_ours:.3g}")
    print("check: " + ("PASS" if not failures else "FAIL\n  " + "\n  ".join(failures)))
    return 1 if failures else 0


def timing_row(setup: Setup, m: int, ceilings: dict[str, float]) -> dict:
    sets = input_sets(setup, m)
    hint = mean_local_rows_per_expert(sets)
    fns = setup.rows(hint)
    terms = [floor_terms(s) for s in sets]
    nbytes, flops = (sum(t[i] for t in terms) / len(sets) for i in range(2))
    row = {"M": m, "sets": len(sets), "hit_experts": sum(s.hit_experts() for s in sets) / len(sets),
           "local_pairs": sum(s.assignments() for s in sets) / len(sets), "hint": hint,
           "floor_us": floor_us(nbytes, flops, ceilings), "bytes_MB": nbytes / 1e6, "GFLOP": flops / 1e9,
           "bound": "bytes" if nbytes / ceilings["copy_bytes_per_s"] >= flops / ceilings["bf16_flop_per_s"] else "FLOPs",
           "ours_backend": setup.ours_backend(sets[0])}
    bf16_terms = [floor_terms(s, bytes_per_expert=setup.grouped.weight_bytes_per_expert()) for s in sets]
    row["grouped_mm_bf16_floor_us"] = floor_us(*(sum(t[i] for t in bf16_terms) / len(sets) for i in range(2)), ceilings)
    row |= errors(setup, sets, fns)
    steps = {name: (lambda i, fn=fn: fn(sets[i].z, sets[i].ids, sets[i].weights)) for name, fn in fns.items()}
    medians = time_graphs_interleaved_ms(steps, len(sets), replays=6 if m <= 4096 else 2)
    for name, ms in medians.items():
        row[f"{name}_us"] = ms * 1e3
        row[f"{name}_x_floor"] = ms * 1e3 / row["floor_us"]
    for name in VARIANTS[1:]:
        row[f"ours_speedup_vs_{name}"] = row[f"{name}_us"] / row["ours_us"]
    return row


COLUMNS = ["M", "ours_us", "peer_us", "peer+hint_us", "grouped_mm_bf16_us", "floor_us", "ours_speedup_vs_peer",
           "ours_speedup_vs_peer+hint", "ours_speedup_vs_grouped_mm_bf16", "ours_x_floor", "peer_x_floor",
           "peer+hint_x_floor", "grouped_mm_bf16_x_floor", "bound", "ours_err", "peer_err", "peer+hint_err",
           "grouped_mm_bf16_err", "peer_vs_ours_err", "hit_experts", "local_pairs", "hint", "sets", "bytes_MB",
           "GFLOP", "grouped_mm_bf16_floor_us", "ours_backend"]


def meta(args: argparse.Namespace, ceilings: dict[str, float] | None) -> dict:
    import triton

    fingerprint = source_fingerprint(args.triton_kernels)
    info = environment() | {
        "triton": triton.__version__,
        "triton_kernels": f"{fingerprint['version']}; sources sha256 {fingerprint['sources_sha256'][:16]}; "
                          f"from {fingerprint['path']}",
        "shape": SHAPE,
        "peer": PEER_SETUP,
    }
    if ceilings is not None:
        info |= {
            "copy_TBps": ceilings["copy_bytes_per_s"] / 1e12,
            "bf16_TFLOPps": ceilings["bf16_flop_per_s"] / 1e12,
            "floor": "max((MXFP4 bytes of the experts hit + z read + y written + ids and weights read) / measured copy "
                     "bandwidth, 2 * 3 * I * L FLOPs per local (token, expert) pair / measured BF16 matmul rate), mean "
                     "over the timed sets; grouped_mm_bf16_floor_us: the same with its BF16 weight bytes; *_x_floor: "
                     "time / floor_us (the task's floor, for every row)",
            "timing": "one CUDA graph per row, one call per rotating input set (each routes to its own experts: "
                      "weights cold in L2), replayed in 5 alternating rounds of 6 replays (2 beyond M = 4096), median "
                      "per call; ours_speedup_vs_X = X_us / ours_us",
            "errors": "relative L2 against a float64 reference (weights dequantised exactly, nothing rounded), the "
                      "largest over the timed sets; peer_vs_ours_err: the peer against ours",
        }
    return info


def run_timing(args: argparse.Namespace, setup: Setup) -> None:
    ceilings = measure_ceilings()
    rows = []
    for m in args.m or DEFAULT_M:
        rows.append(timing_row(setup, m, ceilings))
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
        torch.cuda.empty_cache()  # the graphs of the largest M hold tens of GB
    write_results(args.name, rows, COLUMNS, meta(args, ceilings), args.out, notes=DIFFERENCES)


def run_profile(args: argparse.Namespace, setup: Setup) -> None:
    from bench.peer_profile import kernel_table, table_markdown

    sections = {}
    for m in args.m or PROFILE_M:
        s = rank_inputs(m, setup.gen, "cuda")
        for name in ("ours", "peer"):
            fn = setup.rows(1)[name]
            sections[f"M = {m}, {name}"] = kernel_table(lambda fn=fn: fn(s.z, s.ids, s.weights))
    info = meta(args, None) | {"method": "torch.profiler (CUDA activity) over 5 forwards after one warm call, no CUDA "
                                         "graph; calls and us per forward"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peer_routed_profile.json").write_text(json.dumps({"meta": info, "sections": sections}, indent=2) + "\n")
    header = "\n".join(f"- {k}: {v}" for k, v in info.items())
    (out / "peer_routed_profile.md").write_text(f"# peer_routed_profile\n\n{header}\n\n{table_markdown(sections)}")
    print(table_markdown(sections))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = use_triton_kernels(args.triton_kernels)
    if missing:
        print(f"peer_routed: {missing}. To run the comparison, {HOW_TO_GET}.")
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        found = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        print(f"peer_routed: needs an sm_90 GPU (the peer is set up as vLLM sets it up on Hopper); found {found}")
        return 1
    torch.manual_seed(args.seed)
    setup = Setup(args.seed)
    if args.check:
        return check(args, setup)
    if args.profile:
        run_profile(args, setup)
    else:
        run_timing(args, setup)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
