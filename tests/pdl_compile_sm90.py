"""Compile the PDL variants of the library's kernels for sm_90 on this CPU machine and print, per kernel,
where the grid-dependency instructions sit in the PTX relative to its global memory accesses (JSON).
Run by tests/test_pdl_compile_sm90.py in a fresh interpreter without TRITON_INTERPRET."""

from __future__ import annotations

import json
import re

import triton
from triton.backends.compiler import GPUTarget

from latent_moe_fusion.ops.common.tail_gemm.tail_gemv import tail_gemv_kernel
from latent_moe_fusion.ops.common.tail_gemm.tail_kernels import tail_swap_kernel, tail_swap_tma_kernel
from latent_moe_fusion.ops.routed import gluon as gk
from latent_moe_fusion.ops.routed.gluon import routed_gemm as rg
from latent_moe_fusion.ops.routed.split_k_finish import l1_finish_kernel
from latent_moe_fusion.ops.routed.triton.combine import combine_kernel
from tests.gluon_compile_sm90 import L1_SIG, L2_SIG
from tests.offline_source import ast_source

TARGET = GPUTarget("cuda", 90, 32)


def _triton(fn, sig: dict, consts: dict, warps: int, stages: int = 3, aligned: tuple[str, ...] = ()):
    """aligned: integer arguments the JIT would see as multiples of 16 at the real sizes."""
    sig = dict(sig) | {n: "constexpr" for n in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items()) if t.startswith("*") or n in aligned}
    src = ast_source(fn, sig, consts, attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages, "launch_pdl": True})


def _gluon(fn, sig: dict, consts: dict, warps: int):
    attrs = {(i,): [["tt.divisibility", 16]] for i, (n, t) in enumerate(sig.items())
             if t not in ("fp32", "constexpr") and n != "top_k"}
    sig = dict(sig) | {n: "constexpr" for n in consts}
    src = ast_source(fn, sig, consts, attrs, gluon=True)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "launch_pdl": True})


def positions(ptx: str) -> dict:
    """Line numbers (of the kernel body's instructions) of the first wait / signal / L2 prefetch and of the
    first and last global load, cp.async and bulk tensor copy."""
    lines = [ln.strip() for ln in ptx.splitlines()]

    def first(pattern: str) -> int:
        return next((i for i, ln in enumerate(lines) if re.match(pattern, ln)), -1)

    return {
        "wait": first(r"griddepcontrol\.wait"),
        "signal": first(r"griddepcontrol\.launch_dependents"),
        "prefetch": first(r".*cp\.async\.bulk\.prefetch\.L2"),
        "load": first(r"(@%p\d+ )?ld\.global"),
        "load_v4": first(r"(@%p\d+ )?ld\.global.*\.v4"),
        "cp_async": first(r"(@%p\d+ )?cp\.async\.(ca|cg)"),
        "tensor_copy": first(r"(@%p\d+ )?cp\.async\.bulk\.tensor"),
        "store": first(r"(@%p\d+ )?(st|red|atom)\.global"),
    }


_REG = re.compile(r"%[a-z]+\d+")
_PARAM = re.compile(r"\[(\w+_param_(\d+))\]")


def params_loaded_before_wait(ptx: str, names: list[str]) -> list[list[str]]:
    """For every ld.global before griddepcontrol.wait: the kernel parameters its address derives from.

    A forward data-flow pass over the straight-line code before the wait: `ld.param` seeds a register
    with its parameter, every other instruction's first register (its destination) takes the union of
    the parameters of the registers it reads."""
    origin: dict[str, set[str]] = {}
    loads = []
    for line in (ln.strip() for ln in ptx.splitlines()):
        if line.startswith("griddepcontrol.wait"):
            return loads
        regs = _REG.findall(line.split("//")[0])
        if not regs or line.startswith((".reg", "//", ".loc")):
            continue
        param = _PARAM.search(line)
        if line.startswith("ld.param") and param:
            origin[regs[0]] = {names[int(param.group(2))]}
            continue
        if re.match(r"(@%p\d+ )?ld\.global", line):
            address = line[line.rindex("["):]
            loads.append(sorted(set().union(*(origin.get(r, set()) for r in _REG.findall(address)))))
            continue
        if line.startswith(("st.", "@")):
            continue
        origin[regs[0]] = set().union(*(origin.get(r, set()) for r in regs[1:]))
    return loads


def main() -> None:
    tail_sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "f_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32",
                "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "steps_per_split": "i32",
                "s_am": "i32", "s_ak": "constexpr", "s_wn": "i32", "s_wk": "constexpr", "s_fr": "i32",
                "s_fm": "i32", "s_fn": "constexpr", "s_om": "i32", "s_on": "constexpr"}
    tail_consts = dict(s_ak=1, s_wk=1, s_fn=1, s_on=1, R=1, BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=2,
                       EVEN_K=True, FRAG_GROUP=1, DOT_FP32=False, PRECISION="tf32", PDL=True, PREFETCH_STEPS=4)
    out = {"tail_swap_kernel": _triton(tail_swap_kernel, tail_sig, tail_consts, 4, 5)}
    gemv_sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "f_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
                "K": "i32", "s_am": "i32", "s_ak": "constexpr", "s_wn": "i32", "s_wk": "constexpr", "s_fr": "i32",
                "s_fm": "i32", "s_fn": "constexpr", "s_om": "i32", "s_on": "constexpr"}
    gemv_consts = dict(s_ak=1, s_wk=1, s_fn=1, s_on=1, R=2, BLOCK_N=8, BLOCK_M=1, BLOCK_K=512, PRELOAD_K=1024, STAGES=1,
                       EVEN_K=True, FRAG_GROUP=2, PDL=True)
    gemv = _triton(tail_gemv_kernel, gemv_sig, gemv_consts, 4, aligned=("N", "K", "s_am", "s_wn", "s_fr", "s_fm", "s_om"))
    out["tail_gemv_kernel"] = gemv
    tma_sig = {"a_desc": "tensordesc<bf16[16, 128]>", "w_desc": "tensordesc<bf16[64, 128]>", "f_ptr": "*bf16",
               "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
               "steps_per_split": "i32", "s_fr": "i32", "s_fm": "i32", "s_fn": "i32", "s_om": "i32", "s_on": "i32"}
    tma_consts = dict(R=1, BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=2, FRAG_GROUP=1, DOT_FP32=False,
                      PRECISION="tf32", PDL=True)
    out["tail_swap_tma_kernel"] = _triton(tail_swap_tma_kernel, tma_sig, tma_consts, 4, 4)
    comb_sig = {"pairs_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32", "out_ptr": "*bf16", "rms_ptr": "*bf16",
                "eps": "fp32", "latent": "i32", "slice_stride": "i32"}
    out["combine_kernel"] = _triton(combine_kernel, comb_sig, dict(TOP_K=16, BLOCK_L=4096, NORM=True, INTERPRET=False,
                                                                   SPLIT=2, CHUNK=4096, SIGNAL=True), 8)
    fin_sig = {"h_part_ptr": "*fp32", "block_expert_ptr": "*i32", "act_ptr": "*bf16", "n_rows_r": "i32",
               "inter": "i32", "hs_part_ptr": "*fp32", "act_s_ptr": "*bf16", "m_s": "i32", "inter_s": "i32",
               "beta": "fp32", "lin_beta": "fp32"}
    out["l1_finish_kernel"] = _triton(l1_finish_kernel, fin_sig, dict(BM=16, BLOCK=1024, SPLIT=2, INTERPRET=False,
                                                                      PDL=True), 4)
    common = dict(BM=gk.BLOCK_ROWS[0], BK=gk.STEP_K, SPLIT=2)
    # the default weight ring (loads) takes no descriptor: w_desc is None, as the launcher passes it; STAGES of the
    # GEMV is its default configuration's
    common = common | dict(w_desc=None)
    out["l1_regs_kernel"] = _gluon(rg.l1_regs_kernel, dict(L1_SIG, w_desc="constexpr"),
                                   common | dict(num_warps=gk.L1_WARPS, SIGNAL=True), gk.L1_WARPS)
    out["l2_regs_kernel"] = _gluon(rg.l2_regs_kernel, dict(L2_SIG, w_desc="constexpr"),
                                   common | dict(num_warps=gk.L2_WARPS, PDL=True), gk.L2_WARPS)
    found = {name: positions(k.asm["ptx"]) for name, k in out.items()}
    runtime_args = [n for n, t in gemv_sig.items() if t != "constexpr"]  # the PTX parameters, in order
    found["tail_gemv_kernel"]["before_wait"] = params_loaded_before_wait(gemv.asm["ptx"], runtime_args)
    print(json.dumps(found))


if __name__ == "__main__":
    main()
