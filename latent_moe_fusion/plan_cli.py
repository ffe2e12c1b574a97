"""`python -m latent_moe_fusion plan --m 32`: which routed-expert kernels run for M tokens, one line per decision
with its reason (ops/routed/routed_plan.py). Defaults: one EP8 rank of Kimi K3 on sm_90. --thresholds adds the routed
size thresholds the plan compares against: value, unit, what each decides and where it was measured
(ops/routed/routed_thresholds.json)."""

from __future__ import annotations

import argparse

import torch

from .cli_args import CliError, positive_int
from .kimi_k3_config import KimiK3MoEConfig

_K3 = KimiK3MoEConfig()
EP_SIZE = 8  # the defaults' expert-parallel share: 896 / 8 = 112 local experts


def capability(text: str) -> tuple[int, int] | None:
    """An argparse type: MAJOR.MINOR (e.g. 9.0), or "none" (no CUDA device)."""
    if text.lower() == "none":
        return None
    major, dot, minor = text.partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise argparse.ArgumentTypeError(f"expected MAJOR.MINOR (e.g. 9.0) or none, got {text!r}")
    return int(major), int(minor)


capability.__name__ = "capability"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--m", type=positive_int, required=True, help="tokens in the call (M >= 1)")
    parser.add_argument("--top-k", type=positive_int, default=_K3.top_k, help="slots per token")
    parser.add_argument("--experts", type=positive_int, default=_K3.num_experts // EP_SIZE,
                        help="local experts (default: one EP8 rank of Kimi K3)")
    parser.add_argument("--latent", type=positive_int, default=_K3.latent_size, help="L, the experts' input size")
    parser.add_argument("--inter", type=positive_int, default=_K3.moe_intermediate_size, help="I, per expert")
    parser.add_argument("--shared-rows", type=positive_int, default=None,
                        help="the shared expert's rows in the call (default: M)")
    parser.add_argument("--no-shared", action="store_true", help="no shared expert in the call")
    parser.add_argument("--weights", choices=("mxfp4", "bf16"), default="mxfp4")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--capability", type=capability, default=(9, 0),
                        help="the device's compute capability MAJOR.MINOR, or none (CPU); default 9.0")
    parser.add_argument("--thresholds", action="store_true",
                        help="also print every routed size threshold with its unit, what it decides and its "
                             "measurement (device, date, rule, source)")


def check_arguments(args: argparse.Namespace) -> None:
    """Raise CliError for combinations the routed op cannot take (per-value bounds are argparse types)."""
    if args.top_k > args.experts:
        raise CliError(f"--top-k {args.top_k} exceeds --experts {args.experts}: each slot picks a distinct expert")
    if args.weights == "mxfp4":
        for flag, k in (("--latent", args.latent), ("--inter", args.inter)):
            if k % 32:
                raise CliError(f"{flag} {k}: MXFP4 weights need a multiple of 32 (one scale per 32 values)")
    if args.no_shared and args.shared_rows is not None:
        raise CliError("--no-shared and --shared-rows exclude each other")


def run(args: argparse.Namespace) -> int:
    from .ops.routed.routed_plan import plan_routed

    shared_rows = 0 if args.no_shared else args.shared_rows
    plan = plan_routed(args.m, args.top_k, args.experts, args.latent, args.inter, args.weights,
                       getattr(torch, args.dtype), args.capability, shared_rows)
    print("\n".join(plan.lines()))
    if args.thresholds:
        print("\n".join(threshold_lines()))
    return 0


def threshold_lines() -> list[str]:
    """The routed thresholds' table, after a heading naming its file."""
    from .ops.routed.routed_thresholds import ROUTED_THRESHOLDS

    return [f"thresholds ({ROUTED_THRESHOLDS.path.name}, package data)", *ROUTED_THRESHOLDS.lines()]
