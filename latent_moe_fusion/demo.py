"""`make demo` / `python -m latent_moe_fusion demo`: the reference block eager, compiled, compiled + fused.

CPU: the tiny configuration, bf16. GPU: Kimi K3's real sizes for one rank's expert-parallel share
(--ep-size 8: 112 of 896 experts, MXFP4 weights; ids of other ranks' experts are -1), R = 1.
Prints the fusion report, post-grad node counts, the error of every path against eager and against
a float64 forward of the same block, and median times. The op-level line calls
latent_tail(moe_shared_producer(...)) directly, without torch.compile.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .cli_args import CliError, positive_int
from .fusion_pass import FusionConfig, LatentMoEFusionPass, record_fusion
from .kimi_k3_config import ConfigError, KimiK3MoEConfig
from .model import KimiK3MoEBlock
from .reference64 import block_float64, routing, shared_weights


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=5, rep=max(repeats, 20), return_mode="median"))
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def op_level(block: KimiK3MoEBlock, x: torch.Tensor) -> torch.Tensor:
    """The fused path called op by op: router and down-projection as in the block, then producer + tail."""
    cfg = block.cfg
    ids, weights = routing(block, x)
    z = F.linear(x, block.w_down)
    w1_s, w3_s, w2_s = shared_weights(block)
    y_n, ws = torch.ops.lmf.moe_shared_producer(
        z, ids, weights, block.w13, block.w2, block.w13_scale, block.w2_scale, block.weight_format,
        cfg.situ_beta, cfg.situ_linear_beta, block.norm_weight, cfg.rms_norm_eps, x, w1_s, w3_s, w2_s, "local", None,
    )
    return torch.ops.lmf.latent_tail(y_n, block.w_up, ws, "local", None)


def _compile(block: KimiK3MoEBlock, fusion_pass: LatentMoEFusionPass | None) -> Callable:
    torch._dynamo.reset()
    options = {"post_grad_custom_pre_pass": fusion_pass} if fusion_pass is not None else {}
    return torch.compile(block, options=options, dynamic=False)


def build(device: torch.device, ep_size: int, weight_format: str | None) -> KimiK3MoEBlock:
    if device.type == "cuda":
        cfg = KimiK3MoEConfig()
        return KimiK3MoEBlock(cfg, weight_format=weight_format or "mxfp4", device=device, seed=0, ep_size=ep_size)
    return KimiK3MoEBlock(KimiK3MoEConfig.tiny(), weight_format=weight_format or "bf16", device=device, seed=0)


def run_demo(device: torch.device, tokens: int, repeats: int, ep_size: int, weight_format: str | None,
             allow_reference: bool) -> int:
    torch.manual_seed(0)
    block = build(device, ep_size, weight_format)
    cfg = block.cfg
    x = torch.randn(tokens, cfg.hidden_size, dtype=torch.bfloat16, device=device)
    print(f"block: H={cfg.hidden_size} L={cfg.latent_size} experts={block.num_local_experts}/{cfg.num_experts} "
          f"top_k={cfg.top_k} I={cfg.moe_intermediate_size} I_s={cfg.shared_intermediate_size} "
          f"weights={block.weight_format} dtype=bfloat16 tokens={tokens} device={device} torch={torch.__version__}")
    with torch.no_grad():
        ref64 = block_float64(block, x)
        paths: dict[str, Callable[[], torch.Tensor]] = {"eager": lambda: block(x)}
        eager = block(x)

        unfused = _compile(block, None)
        outputs = {"eager": eager, "compiled": unfused(x)}
        times = {"eager": median_ms(paths["eager"], device, repeats),
                 "compiled": median_ms(lambda: unfused(x), device, repeats)}

        devices = ("cpu", "cuda") if allow_reference else ("cpu",)
        fusion_pass = LatentMoEFusionPass(FusionConfig(reference_backend_devices=devices))
        fused = _compile(block, fusion_pass)
        with record_fusion() as record:  # the graph may come from Inductor's FX graph cache: the pass then did not run
            outputs["compiled + fused"] = fused(x)
        times["compiled + fused"] = median_ms(lambda: fused(x), device, repeats)

        outputs["op-level producer + tail"] = op_level(block, x)
        times["op-level producer + tail"] = median_ms(lambda: op_level(block, x), device, repeats)

    report = record.reports[-1] if record.reports else fusion_pass.report
    print(report.summary())
    print(f"post-grad nodes: compiled {report.nodes_before}, compiled + fused {report.nodes_after}")
    print(f"{'path':<26} {'rel L2 vs eager':>16} {'rel L2 vs float64':>18} {'median ms':>10}")
    for name, out in outputs.items():
        print(f"{name:<26} {rel_l2(out, eager):>16.3e} {rel_l2(out, ref64):>18.3e} {times[name]:>10.3f}")
    return 0 if report.matched == 1 else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--tokens", type=positive_int, default=64, help="tokens M of the batch (>= 1)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed calls per path (>= 1)")
    parser.add_argument("--ep-size", type=positive_int, default=8,
                        help="GPU only: this rank holds num_experts/ep_size experts (a divisor of num_experts)")
    parser.add_argument("--weights", choices=("bf16", "mxfp4"), default=None,
                        help="expert weight format (default: bf16 on CPU, mxfp4 on GPU)")
    parser.add_argument("--allow-reference", action="store_true",
                        help="on a GPU, fuse even where only the (slow) reference backend serves the fused ops")


def _device(args: argparse.Namespace) -> torch.device:
    if args.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(args.device)


def check_arguments(args: argparse.Namespace) -> None:
    """Raise CliError for values the demo cannot run with (the per-value bounds are argparse types)."""
    if _device(args).type == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available here (use --device cpu or auto)")
    try:  # the flag means the same on every device, though only the GPU's Kimi K3 sizes use it
        KimiK3MoEConfig().validate_for(1, "bf16", args.ep_size)
    except ConfigError as exc:
        raise CliError(f"--ep-size {args.ep_size}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    return run_demo(_device(args), args.tokens, args.repeats, args.ep_size, args.weights, args.allow_reference)
