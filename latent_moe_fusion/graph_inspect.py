"""`python -m latent_moe_fusion inspect [--tp N] [--sp]`: the post-grad graph before and after the pass.

Compiles one tiny block on CPU up to the fusion pass (kernel code generation is skipped: this shows
graphs, not kernels). With --tp N the block runs on a single-process stand-in for an N-rank group
(torch's fake process group): the collectives are traced exactly as on N real ranks.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass

from .cli_args import CliError, positive_int
from .fusion_pass import FusionReport, LatentMoEFusionPass
from .kimi_k3_config import ConfigError, KimiK3MoEConfig
from .model import KimiK3MoEBlock


class _Captured(Exception):
    """Raised after the pass ran: ends the compile before code generation."""


class _CapturePass(CustomGraphPass):
    def __init__(self, inner: LatentMoEFusionPass) -> None:
        self.inner = inner
        self.before: str | None = None
        self.after: str | None = None

    def __call__(self, graph) -> None:
        self.before = graph.python_code("self").src
        self.inner(graph)
        self.after = graph.python_code("self").src
        raise _Captured

    def uuid(self) -> None:
        return None  # never cache a compile that is cut short


@dataclass
class Inspection:
    before: str
    after: str
    report: FusionReport


@contextlib.contextmanager
def simulated_group(world: int) -> Iterator[dist.ProcessGroup | None]:
    """None for one rank; else a fake `world`-rank group in this process (or the live default group)."""
    if world == 1:
        yield None
        return
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise RuntimeError(f"a {dist.get_world_size()}-rank process group is live; --tp {world} needs {world}")
        yield dist.group.WORLD
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def inspect_block(
    tp: int = 1,
    sp: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    shared_gate_up: str = "merged",
    rms_norm: str = "functional",
    weight_format: str = "bf16",
    tokens: int = 8,
    fusion_pass: LatentMoEFusionPass | None = None,
) -> Inspection:
    if sp and tp < 2:
        raise ValueError("--sp needs --tp N with N >= 2")
    cfg = KimiK3MoEConfig.tiny()
    with simulated_group(tp) as group:
        block = KimiK3MoEBlock(cfg, tp_group=group, sequence_parallel=sp, weight_format=weight_format, dtype=dtype,
                               shared_gate_up=shared_gate_up, rms_norm=rms_norm)
        fusion_pass = fusion_pass if fusion_pass is not None else LatentMoEFusionPass()
        capture = _CapturePass(fusion_pass)
        x = torch.randn(tokens, cfg.hidden_size, dtype=dtype)
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False, compile_threads=1):
            try:
                torch.compile(block, options={"post_grad_custom_pre_pass": capture}, dynamic=False)(x)
            except Exception:
                if capture.after is None:
                    raise
    return Inspection(capture.before, capture.after, fusion_pass.report)


def format_inspection(result: Inspection) -> str:
    report = result.report
    removed = sum(report.ops_removed().values())
    added = sum(report.ops_added().values())
    return "\n".join([
        "=" * 30 + " post-grad graph before the fusion pass " + "=" * 30,
        result.before.strip(),
        "=" * 30 + " post-grad graph after the fusion pass " + "=" * 31,
        result.after.strip(),
        "=" * 30 + " summary " + "=" * 60,
        report.summary(),
        f"  nodes: {report.nodes_before} -> {report.nodes_after} ({removed} ops removed, {added} ops added)",
    ])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="TP world size R >= 1 (simulated in this process; a divisor of the tiny block's sizes)")
    parser.add_argument("--sp", action="store_true", help="sequence parallel: all_gather in, reduce_scatter out")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--gate-up", choices=("merged", "split"), default="merged")
    parser.add_argument("--rms-norm", choices=("functional", "manual"), default="functional")
    parser.add_argument("--weights", choices=("bf16", "mxfp4"), default="bf16")


def check_arguments(args: argparse.Namespace) -> None:
    """Raise CliError for values the inspection cannot run with (the per-value bounds are argparse types)."""
    if args.sp and args.tp < 2:
        raise CliError("--sp needs --tp N with N >= 2")
    try:
        KimiK3MoEConfig.tiny().validate_for(args.tp, args.weights)
    except ConfigError as exc:
        raise CliError(f"--tp {args.tp}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    result = inspect_block(tp=args.tp, sp=args.sp, dtype=getattr(torch, args.dtype), shared_gate_up=args.gate_up,
                           rms_norm=args.rms_norm, weight_format=args.weights)
    print(format_inspection(result))
    return 0 if result.report.matched else 1
