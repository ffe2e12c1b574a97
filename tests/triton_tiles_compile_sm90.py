"""The producer's Triton L1 and L2 kernels (`l1_kernel`: routed gate/up + SiTU, shared gate/up; `l2_kernel`: routed
down, shared down) compiled for sm_90 on a machine without a GPU, for each MXFP4 dequantiser and weight-load form,
with the static instruction count of the routed branch's K loop per variant (JSON). Run by
tests/test_kernels_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET.

The configuration is pick_config's MXFP4 decode one (BM 16; L1 routed tiles 64 rows x BK 128, 4 warps, 4 stages;
L2 64 x 128, 4 stages, 128 registers). Static counts are not times: on the H200 the table-lookup + TMA loop had
2.8x fewer static instructions than pointers + bias multiply, yet executed 15 % fewer and ran as fast, because
the loop is latency-bound at 12 warps per SM (docs/design/producer.md).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
from pathlib import Path

import torch
import triton

from latent_moe_fusion.ops.routed import producer_config
from latent_moe_fusion.ops.routed.producer_config import pick_config
from latent_moe_fusion.ops.routed.triton import weight_tiles as wt
from latent_moe_fusion.ops.routed.triton.expert_gemm import l1_kernel, l2_kernel
from tests.offline_source import ast_source
from tests.sm90_sass import SM90, main_loop, sass_of

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
    src = ast_source(l2_kernel, sig, consts)
    return triton.compile(src, target=SM90, options=t.launch_options()), cfg


def compile_l1_sm90(dequant: int, tma: bool = False) -> tuple[triton.compiler.CompiledKernel, object]:
    cfg = pick_config(512, "mxfp4", torch.bfloat16, 112)  # M = 32 at top-16; on a CPU machine: the sm_90 decode tiles
    t = cfg.l1
    desc = f"tensordesc<u8[{t.bn},{t.bk // 2}]>" if tma else "*u8"
    sig = (PTRS | {"w13_desc": desc} | {n: "i32" for n in INTS} | {"beta": "fp32", "lin_beta": "fp32"}
           | {"h_part_ptr": "*fp32", "hs_part_ptr": "*fp32", "n_rows_r": "i32"})
    consts = dict(BM=cfg.bm, BN=t.bn, BK=t.bk, BNS=t.shared_bn, BKS=t.bk_shared, MXFP4=True, DEQUANT=dequant,
                  INTERPRET=False, DOT_PREC=None, WDESC=tma, SPLIT=t.split_k)
    sig |= {n: "constexpr" for n in consts}
    src = ast_source(l1_kernel, sig, consts)
    return triton.compile(src, target=SM90, options=t.launch_options()), cfg


def on_sm90_machine() -> None:
    """pick_config asks the local GPU whether it is sm_90; answer yes, and not the interpreter's tiles."""
    producer_config._has_sm90 = lambda: True
    producer_config.interpreting = lambda: False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="folder for triton_tiles_sass.json")
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "triton_tiles_sass.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
