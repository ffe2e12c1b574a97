"""`python -m latent_moe_fusion plan-tail --m 32`: which latent-tail backend and kernel run for M tokens on a rank,
one line per decision with its reason (ops/tail/tail_plan.py). Defaults: Kimi K3's sizes, one rank, sm_90 (H200)."""

from __future__ import annotations

import argparse
import sys

import torch

from .cli_args import CliError, positive_int
from .kimi_k3_config import KimiK3MoEConfig
from .ops.common.fragment_layouts import MODES
from .plan_cli import capability

_K3 = KimiK3MoEConfig()
CUTE_CHOICES = {"auto": None, "yes": True, "no": False}  # --cute: installed where the plan runs, or given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--m", type=positive_int, required=True,
                        help="tokens of the tail's output on this rank (token_publish: this rank's share)")
    parser.add_argument("--hidden", type=positive_int, default=_K3.hidden_size, help="H, the output width")
    parser.add_argument("--latent", type=positive_int, default=_K3.latent_size, help="L, the input width")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--mode", choices=MODES, default="local",
                        help="fragment layout: local (one rank), hidden_scatter (TP), token_publish (SP)")
    parser.add_argument("--world-size", type=positive_int, default=1, help="ranks the mode spans (R)")
    parser.add_argument("--capability", type=capability, default=(9, 0),
                        help="the device's compute capability MAJOR.MINOR, or none (CPU); default 9.0")
    parser.add_argument("--sms", type=positive_int, default=132, help="the device's SM count (H200: 132)")
    parser.add_argument("--cute", choices=tuple(CUTE_CHOICES), default="auto",
                        help="whether the CuTe DSL is installed there (auto: as here)")


def check_arguments(args: argparse.Namespace) -> None:
    """Raise CliError for combinations the tail cannot take (per-value bounds are argparse types)."""
    from .ops.tail.tail_plan import shape_problem

    if args.mode == "local" and args.world_size != 1:
        raise CliError(f"--mode local is one rank, got --world-size {args.world_size}: use --mode hidden_scatter (TP) "
                       "or token_publish (SP)")
    if args.hidden % args.world_size:
        raise CliError(f"--hidden {args.hidden} is not divisible by --world-size {args.world_size}: every rank "
                       "holds H / R columns")
    problem = shape_problem(args.m, args.hidden, args.latent, args.mode, args.world_size, getattr(torch, args.dtype))
    if problem is not None:
        raise CliError(problem)


def run(args: argparse.Namespace) -> int:
    from .ops.tail.tail_plan import plan_tail

    try:
        plan = plan_tail(args.m, args.hidden, args.latent, getattr(torch, args.dtype), args.mode, args.world_size,
                         args.capability, args.sms, CUTE_CHOICES[args.cute])
    except (RuntimeError, ValueError) as exc:  # a forced backend that cannot run, a bad switch: the op would raise
        print(f"plan-tail: {exc}", file=sys.stderr)
        return 1
    print("\n".join(plan.lines()))
    return 0
