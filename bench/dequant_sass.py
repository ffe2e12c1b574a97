"""Static SASS cost of the MXFP4 dequantisers, without a GPU: each variant's weight-step loop is
compiled for sm_90 (Triton + its bundled ptxas) and the instructions of the main loop are counted.

The kernels are the producer's L1 (`l1_kernel`: routed gate/up + SiTU, shared gate/up) and L2
(`l2_kernel`: routed down, shared down) with the MXFP4 decode configuration of `pick_config`
(BM 16; L1 routed tiles 64 rows x BK 128, 4 warps, 4 stages; L2 64 x 128, 4 stages, 128
registers); the routed loop is the longest loop with a dequantiser in it. Instructions per weight
element = loop instructions x threads / (rows x BK per step; L1 loads a gate and an up tile).
It is not a timing, and on the H200 it did not predict one: the table-lookup + TMA loop has 2.8x
fewer static instructions than the pointer + bias-multiply one, but ncu counted only 15 % fewer
executed instructions (the static range of the pointer variant spans peeled iterations) and the
kernel time did not move, because the loop is latency-bound at 12 warps per SM (producer_notes.md,
run 5). Measure on a GPU before changing a default.

    PYTHONPATH=. python3 bench/dequant_sass.py --out bench/results
"""

from __future__ import annotations

import argparse
import collections
import itertools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latent_moe_fusion.ops.routed import producer_config  # noqa: E402
from latent_moe_fusion.ops.routed.producer_config import pick_config  # noqa: E402
from latent_moe_fusion.ops.routed.triton import weight_tiles as wt  # noqa: E402
from latent_moe_fusion.ops.routed.triton.expert_gemm import l1_kernel, l2_kernel  # noqa: E402

VARIANTS = {"triton": wt.DEQUANT_TRITON, "asm": wt.DEQUANT_ASM, "asm_pairs": wt.DEQUANT_ASM_PAIRS,
            "lut": wt.DEQUANT_LUT, "dot_scaled": wt.DEQUANT_DOT_SCALED}


PTRS = {"z_ptr": "*bf16", "w13_ptr": "*u8", "w13s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
        "act_ptr": "*bf16", "x_ptr": "*bf16", "w1s_ptr": "*bf16", "w3s_ptr": "*bf16", "act_s_ptr": "*bf16"}
INTS = ("latent", "inter", "top_k", "stride_we", "stride_wn", "stride_se", "stride_sn", "hidden", "inter_s", "m_s",
        "n_shared_tiles", "tiles_n_r", "tiles_n_s")


L2_PTRS = {"act_ptr": "*bf16", "w2_ptr": "*u8", "w2s_ptr": "*u8", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
           "pairs_ptr": "*fp32"}
L2_INTS = ("latent", "inter", "stride_we", "stride_wn", "stride_se", "stride_sn")
L2_SHARED = {"act_s_ptr": "*bf16", "w2sh_ptr": "*bf16", "ws_ptr": "*bf16"}
L2_TAIL_INTS = ("hidden", "inter_s", "m_s", "n_shared_tiles", "tiles_n_r", "tiles_n_s", "num_pairs")


def compile_l2_sm90(dequant: int, tma: bool = False) -> tuple[triton.compiler.CompiledKernel, object]:
    cfg = pick_config(512, "mxfp4", torch.bfloat16, 112)
    t = cfg.l2
    desc = f"tensordesc<u8[{t.bn},{t.bk // 2}]>" if tma else "*u8"
    sig = (L2_PTRS | {"w2_desc": desc} | {n: "i32" for n in L2_INTS} | L2_SHARED
           | {n: "i32" for n in L2_TAIL_INTS})
    consts = dict(BM=cfg.bm, BN=t.bn, BK=t.bk, BNS=t.shared_bn, BKS=t.bk_shared, MXFP4=True, DEQUANT=dequant,
                  INTERPRET=False, DOT_PREC=None, WDESC=tma, SPLIT=t.split_k)
    sig |= {n: "constexpr" for n in consts}
    src = ASTSource(fn=l2_kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=t.launch_options()), cfg


def compile_l1_sm90(dequant: int, tma: bool = False) -> tuple[triton.compiler.CompiledKernel, object]:
    cfg = pick_config(512, "mxfp4", torch.bfloat16, 112)  # M = 32 at top-16; on a CPU machine: the sm_90 decode tiles
    t = cfg.l1
    desc = f"tensordesc<u8[{t.bn},{t.bk // 2}]>" if tma else "*u8"
    sig = (PTRS | {"w13_desc": desc} | {n: "i32" for n in INTS} | {"beta": "fp32", "lin_beta": "fp32"}
           | {"h_part_ptr": "*fp32", "hs_part_ptr": "*fp32", "n_rows_r": "i32"})
    consts = dict(BM=cfg.bm, BN=t.bn, BK=t.bk, BNS=t.shared_bn, BKS=t.bk_shared, MXFP4=True, DEQUANT=dequant,
                  INTERPRET=False, DOT_PREC=None, WDESC=tma, SPLIT=t.split_k)
    sig |= {n: "constexpr" for n in consts}
    src = ASTSource(fn=l1_kernel, signature=sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=t.launch_options()), cfg


def sass_of(cubin: bytes) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout


def loop_ranges(sass: str) -> list[list[str]]:
    """Opcodes of every backward-branch range of the SASS (from the branch target to the branch): the
    loops, inner ones inside outer ones."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", sass)
    addr = [(int(a, 16), op, rest) for a, op, rest in lines]
    ranges = []
    for i, (a, op, rest) in enumerate(addr):
        m = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if m and int(m.group(1), 16) < a:
            start = next(j for j, x in enumerate(addr) if x[0] >= int(m.group(1), 16))
            ranges.append([op for _, op, _ in addr[start:i + 1]])
    return ranges


def main_loop(sass: str) -> list[str]:
    """Opcodes of the K loop of the routed branch: the longest backward-branch range that multiplies
    bf16 pairs (the dequantiser's scale) and evaluates no transcendental (MUFU: the SiTU after the
    loop; ranges of peeled iterations can span both). Without such a range (the Triton variant
    converts in FP32): the longest one."""
    ranges = loop_ranges(sass)
    dequant = [r for r in ranges if any(o.startswith("HMUL2") for o in r) and not any(o.startswith("MUFU") for o in r)]
    return max(dequant or ranges, key=len, default=[])


def on_sm90_machine() -> None:
    """pick_config asks the local GPU whether it is sm_90; answer yes, and not the interpreter's tiles."""
    producer_config._has_sm90 = lambda: True
    producer_config.interpreting = lambda: False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--kernels", nargs="*", choices=("l1", "l2"), default=["l1", "l2"])
    ap.add_argument("--loads", nargs="*", choices=("pointers", "tma"), default=["pointers", "tma"],
                    help="routed weight tiles through per-element pointers or tensor descriptors")
    args = ap.parse_args()
    on_sm90_machine()
    rows = []
    for which, loads, name in itertools.product(args.kernels, args.loads, args.variants):
        build = compile_l1_sm90 if which == "l1" else compile_l2_sm90
        kernel, cfg = build(VARIANTS[name], tma=loads == "tma")
        tiles = cfg.l1 if which == "l1" else cfg.l2
        per_step = (2 if which == "l1" else 1) * tiles.bn * tiles.bk  # L1: a gate and an up tile per step
        ops = main_loop(sass_of(kernel.asm["cubin"]))
        hist = collections.Counter(op.split(".")[0] for op in ops)
        rows.append({"kernel": which, "variant": name, "loads": loads, "loop_instr": len(ops),
                     "per_element": len(ops) * tiles.num_warps * 32 / per_step, "LDL": hist["LDL"], "HMUL2": hist["HMUL2"],
                     "UTMALDG": hist["UTMALDG"], "top": ", ".join(f"{k} {v}" for k, v in hist.most_common(8))})
        print(rows[-1], flush=True)
    lines = [f"# MXFP4 dequant: static SASS of the weight-step loop (sm_90, triton {triton.__version__})", "",
             f"`l1_kernel` / `l2_kernel`, MXFP4 decode config: {cfg}; compiled on a CPU machine, not timed.", "",
             "Static counts are not times: on the H200 the LUT + TMA loop (2.8x fewer static instructions than "
             "asm_pairs + pointers in L1) executed 15 % fewer instructions and ran as fast (ncu, M = 32: "
             "1.03 vs 1.04 ms); see producer_notes.md, run 5.", "",
             "| kernel | variant | weight loads | loop instructions / thread | instructions / weight element | LDL | "
             "UTMALDG | HMUL2 | most frequent opcodes |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['variant']} | {r['loads']} | {r['loop_instr']} | {r['per_element']:.2f} | "
              f"{r['LDL']} | {r['UTMALDG']} | {r['HMUL2']} | {r['top']} |" for r in rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dequant_sass.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
