"""Host time of one call of each lmf op, layer by layer (what a forward outside CUDA graphs pays).

Outside CUDA graphs (prefill) the GPU idles whenever the host takes longer to launch an op's kernels
than the GPU takes to run the work queued before them (bench/host_gaps.py). This measures, per op on a
Kimi K3 rank's inputs: the whole call through the dispatcher, its argument checks, the backend choice,
the backend itself, and the same op registered through `torch.library.custom_op` (the registration
the ops used before; ops/common/op_library.py says why they no longer do), in grad mode and under inference_mode.
Each figure is the median host time of one call with the GPU idle before it and no sync after it.

    PYTHONPATH=. python3 bench/op_host_time.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.block import kimi_rank_block  # noqa: E402
from bench.common import environment, host_us, write_results  # noqa: E402
from latent_moe_fusion.model.router import localize_ids, route  # noqa: E402
from latent_moe_fusion.ops.common.backends import select_backend  # noqa: E402
from latent_moe_fusion.ops.routed import producer_op  # noqa: E402
from latent_moe_fusion.ops.routed.expert_validation import validate_routed  # noqa: E402
from latent_moe_fusion.ops.tail import tail_op  # noqa: E402
from latent_moe_fusion.ops.tail.tail_validation import validate_tail  # noqa: E402


@triton.jit
def _copy_kernel(ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(ptr + offs, tl.load(ptr + offs, mask=offs < n), mask=offs < n)


@torch.library.custom_op("lmfbench::latent_tail", mutates_args=())
def _tail_as_custom_op(y_n: torch.Tensor, w_up: torch.Tensor, ws: torch.Tensor, mode: str,
                       group_name: str | None = None) -> torch.Tensor:
    return tail_op._latent_tail(y_n, w_up, ws, mode, group_name)


@torch.library.custom_op("lmfbench::moe_shared_producer", mutates_args=())
def _producer_as_custom_op(
    z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    w13_scale: torch.Tensor | None, w2_scale: torch.Tensor | None, weight_format: str, beta: float, lin_beta: float,
    rms_weight: torch.Tensor, eps: float, x_s: torch.Tensor, w1_s: torch.Tensor, w3_s: torch.Tensor,
    w2_s: torch.Tensor, mode: str, group_name: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return producer_op._moe_shared_producer(z, topk_ids, topk_weights, w13, w2, w13_scale, w2_scale, weight_format, beta,
                                        lin_beta, rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group_name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    ap.add_argument("--m", type=int, nargs="*", default=[1, 4096])
    args = ap.parse_args()
    block = kimi_rank_block("bf16")
    cfg = block.cfg
    scratch = torch.zeros(1024, device="cuda")
    rows = [
        {"M": "-", "op": "baseline", "layer": "Triton launch, 3 arguments"}
        | dict(zip(("grad_us", "grad_min_us"), host_us(lambda: _copy_kernel[(1,)](scratch, 10, BLOCK=64)), strict=True)),
        {"M": "-", "op": "baseline", "layer": "torch.empty"}
        | dict(zip(("grad_us", "grad_min_us"), host_us(lambda: torch.empty(1024, 1024, device="cuda")), strict=True)),
    ]
    i_s = block.shared_w2.shape[1]
    for m in args.m:
        x = torch.randn(m, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        ids, w = route(x, block.gate_weight, block.correction_bias, cfg.top_k, cfg.routed_scaling_factor,
                       block.router_gemm)
        ids = localize_ids(ids, block.first_expert, block.num_local_experts)
        z = F.linear(x, block.w_down)
        routed = (z, ids, w, block.w13, block.w2, block.w13_scale, block.w2_scale, "mxfp4", cfg.situ_beta,
                  cfg.situ_linear_beta)
        producer = routed + (block.norm_weight, cfg.rms_norm_eps, x, block.shared_w13[:i_s], block.shared_w13[i_s:],
                             block.shared_w2, "local", None)
        y_n, ws = torch.ops.lmf.moe_shared_producer(*producer)
        tail = (y_n, block.w_up, ws, "local", None)
        layers = {
            "routed_experts": {
                "op call": lambda: torch.ops.lmf.routed_experts(*routed),
                "argument checks": lambda: validate_routed("routed_experts", *routed, ids=False),
                "backend choice": lambda: select_backend("routed_experts", "cuda", *routed),
                "backend": lambda: select_backend("routed_experts", "cuda", *routed).fn(*routed),
            },
            "moe_shared_producer": {
                "op call": lambda: torch.ops.lmf.moe_shared_producer(*producer),
                "op call as custom_op": lambda: torch.ops.lmfbench.moe_shared_producer(*producer),
                "backend choice": lambda: select_backend("moe_shared_producer", "cuda", *producer),
                "backend": lambda: select_backend("moe_shared_producer", "cuda", *producer).fn(*producer),
            },
            "latent_tail": {
                "op call": lambda: torch.ops.lmf.latent_tail(*tail),
                "op call as custom_op": lambda: torch.ops.lmfbench.latent_tail(*tail),
                "argument checks": lambda: validate_tail("latent_tail", *tail),
                "backend choice": lambda: select_backend("latent_tail", "cuda", *tail),
                "backend": lambda: select_backend("latent_tail", "cuda", *tail).fn(*tail),
            },
        }
        op_args = {"routed_experts": routed, "moe_shared_producer": producer, "latent_tail": tail}
        for op, fns in layers.items():
            backend = select_backend(op, "cuda", *op_args[op]).name
            for layer, fn in fns.items():
                label = f"backend {backend} (incl. the choice)" if layer == "backend" else layer
                row = {"M": m, "op": op, "layer": label}
                row["grad_us"], row["grad_min_us"] = host_us(fn)
                with torch.inference_mode():
                    row["inference_mode_us"], row["inference_mode_min_us"] = host_us(fn)
                rows.append(row)
                print(row, flush=True)
    meta = environment() | {
        "config": "Kimi K3 one rank of TP8/EP8 (bench/block.py), MXFP4 routed weights, router GEMM bf16",
        "timing": "host time of one call (perf_counter), GPU idle before it, no sync after; median and minimum of 60",
        "note": "op call includes the id range check, finished after the launches (validation.DeferredIdCheck)",
    }
    write_results("op_host_time", rows, ["M", "op", "layer", "grad_us", "grad_min_us", "inference_mode_us",
                                        "inference_mode_min_us"], meta, args.out)


if __name__ == "__main__":
    main()
