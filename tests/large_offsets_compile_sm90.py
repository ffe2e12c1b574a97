"""Compile every kernel that takes LARGE_OFFSETS (the tail's five, the producer's Triton L1 and L2 at prefill tiles)
for sm_90 on this CPU machine with the flag off and on, and print per kernel and flag how many pointer offsets the
TTIR adds in 64 bits (JSON, one line). Run by tests/test_large_offsets_compile_sm90.py in a fresh interpreter
without TRITON_INTERPRET."""

from __future__ import annotations

import json
import re

import torch
import triton

from latent_moe_fusion.ops.common.tail_gemm.tail_gemv import tail_gemv_kernel
from latent_moe_fusion.ops.common.tail_gemm.tail_kernels import (
    tail_swap_kernel,
    tail_swap_tma_kernel,
    tail_tile_kernel,
    tail_tile_tma_kernel,
)
from latent_moe_fusion.ops.routed.producer_config import pick_config
from latent_moe_fusion.ops.routed.triton.expert_gemm import l1_kernel, l2_kernel
from tests import triton_tiles_compile_sm90 as tiles
from tests.offline_source import ast_source
from tests.sm90_sass import SM90

TAIL = {"a_ptr": "*bf16", "w_ptr": "*bf16", "f_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
STRIDES = {"s_am": "i32", "s_ak": "constexpr", "s_wn": "i32", "s_wk": "constexpr", "s_fr": "i32", "s_fm": "i32",
           "s_fn": "constexpr", "s_om": "i32", "s_on": "constexpr"}
UNIT = dict(s_ak=1, s_wk=1, s_fn=1, s_on=1)
SPLIT = {"part_ptr": "*fp32", "count_ptr": "*i32"}
DESC_STRIDES = {"s_fr": "i32", "s_fm": "i32", "s_fn": "i32", "s_om": "i32", "s_on": "i32"}
DOTS = dict(DOT_FP32=False, PRECISION="tf32")


def _tail_cases() -> dict:
    """(kernel, signature, constexprs, warps, stages) of one table-like specialisation per tail kernel."""
    return {
        "tail_gemv_kernel": (tail_gemv_kernel, TAIL | STRIDES, UNIT | dict(
            R=2, BLOCK_N=4, BLOCK_M=1, BLOCK_K=512, PRELOAD_K=1024, STAGES=1, EVEN_K=True, FRAG_GROUP=2), 1, 1),
        "tail_swap_kernel": (tail_swap_kernel, TAIL | SPLIT | {"steps_per_split": "i32"} | STRIDES, UNIT | dict(
            R=2, BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=2, EVEN_K=True, FRAG_GROUP=2, **DOTS), 4, 4),
        "tail_swap_tma_kernel": (tail_swap_tma_kernel, {
            "a_desc": "tensordesc<bf16[32, 128]>", "w_desc": "tensordesc<bf16[64, 128]>", "f_ptr": "*bf16",
            "out_ptr": "*bf16"} | SPLIT | {"M": "i32", "N": "i32", "K": "i32", "steps_per_split": "i32"} | DESC_STRIDES,
            dict(R=2, BLOCK_N=64, BLOCK_M=32, BLOCK_K=128, SPLIT_K=2, FRAG_GROUP=2, **DOTS), 4, 4),
        "tail_tile_kernel": (tail_tile_kernel, TAIL | STRIDES, UNIT | dict(
            R=2, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, EVEN_K=True, FRAG_GROUP=2, FLATTEN=False, **DOTS),
            8, 3),
        "tail_tile_tma_kernel": (tail_tile_tma_kernel, {
            "a_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[256, 64]>", "f_ptr": "*bf16",
            "out_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"} | DESC_STRIDES,
            dict(R=2, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, FRAG_GROUP=2, FLATTEN=False, **DOTS), 8, 3),
    }


def _producer_cases() -> dict:
    """The Triton L1 and L2 at the prefill tiles pick_config gives one Kimi K3 rank (112 experts) without the
    register-dequant kernels: where LARGE_OFFSETS is set."""
    cfg = pick_config(1 << 20, "mxfp4", torch.bfloat16, 112).with_k_dims((3584, 3072), (7168, 768), True)
    assert cfg.bm == 128 and not cfg.routed_regs, cfg
    cases = {}
    for name, fn, t, sig in (
        ("l1_kernel", l1_kernel, cfg.l1, tiles.PTRS | {"w13_desc": "*u8"} | {n: "i32" for n in tiles.INTS}
         | {"beta": "fp32", "lin_beta": "fp32", "h_part_ptr": "*fp32", "hs_part_ptr": "*fp32", "n_rows_r": "i32"}),
        ("l2_kernel", l2_kernel, cfg.l2, tiles.L2_PTRS | {"w2_desc": "*u8"} | {n: "i32" for n in tiles.L2_INTS}
         | tiles.L2_SHARED | {n: "i32" for n in tiles.L2_TAIL_INTS}),
    ):
        consts = dict(BM=cfg.bm, BN=t.bn, BK=t.bk, BNS=t.shared_bn, BKS=t.bk_shared, MXFP4=True, DEQUANT=cfg.dequant,
                      INTERPRET=False, DOT_PREC=None, WDESC=False, SPLIT=1)
        cases[name] = (fn, sig, consts, t.num_warps, t.num_stages)
    return cases


def _compile(fn, sig: dict, consts: dict, warps: int, stages: int):
    sig = dict(sig) | {n: "constexpr" for n in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t.startswith("*")}
    src = ast_source(fn, sig, consts, attrs)
    return triton.compile(src, target=SM90, options={"num_warps": warps, "num_stages": stages})


def wide_offsets(ttir: str) -> int:
    """tt.addptr ops whose offset is 64-bit (scalar or tensor)."""
    return len(re.findall(r"tt\.addptr [^:]*: [^,]+, (?:tensor<[^>]*xi64>|i64)", ttir))


def main() -> None:
    tiles.on_sm90_machine()
    out = {}
    for name, (fn, sig, consts, warps, stages) in (_tail_cases() | _producer_cases()).items():
        for large in (False, True):
            kernel = _compile(fn, sig, consts | {"LARGE_OFFSETS": large}, warps, stages)
            out[f"{name} large={large}"] = {"wide_offsets": wide_offsets(kernel.asm["ttir"]),
                                            "cubin_bytes": len(kernel.asm["cubin"])}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
