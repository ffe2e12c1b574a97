"""Models and compile helpers for the fusion-pass tests (tiny config, CPU).

`post_grad(model, args, fusion_pass)` compiles up to the fusion pass and stops there (no kernel
codegen: seconds instead of tens of seconds); `compiled(model, fusion_pass)` compiles fully. Both
reset dynamo first and turn the FX graph cache off, so the pass runs and its report is fresh.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import ChainedGraphPass

CFG = lmf.KimiK3MoEConfig.tiny()
PRODUCER = "lmf.moe_shared_producer.default"
# The producer with the router and the down-projection that feed it (fusion_pass/router_overlap.py), and for an SP
# block with the all-gather of its tokens too.
ROUTE_AND_PRODUCE = "lmf.route_and_produce.default"
ROUTE_GATHER_AND_PRODUCE = "lmf.route_gather_and_produce.default"
ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"


def producers(ops_after) -> int:
    """Producers in a fused graph: lmf::moe_shared_producer, or lmf::route_and_produce where the router and the
    down-projection that feed it went in with it, or lmf::route_gather_and_produce where an SP block's token gather
    went in too."""
    return ops_after[PRODUCER] + ops_after[ROUTE_AND_PRODUCE] + ops_after[ROUTE_GATHER_AND_PRODUCE]


TAIL = "lmf.latent_tail.default"
# (shared_gate_up, rms_norm, weight_format): every gate/up x RMSNorm variant, both weight formats.
VARIANTS = (
    ("merged", "functional", "mxfp4"),
    ("merged", "manual", "bf16"),
    ("split", "functional", "bf16"),
    ("split", "manual", "mxfp4"),
)


class Stacked(nn.Module):
    """Blocks applied one after the other (block i's output is block i+1's input)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Side(nn.Module):
    """Independent models on the same input, outputs returned as a tuple: one graph, several blocks."""

    def __init__(self, models: list[nn.Module]) -> None:
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(m(x) for m in self.models)


def block(seed: int = 0, **kwargs) -> lmf.KimiK3MoEBlock:
    return lmf.KimiK3MoEBlock(CFG, seed=seed, **kwargs)


def variant_stacks(dtype: torch.dtype, tp_group=None, sequence_parallel: bool = False, depth: int = 2) -> Side:
    """One stack of `depth` blocks per entry of VARIANTS."""
    stacks = []
    for v, (gate_up, norm, weight_format) in enumerate(VARIANTS):
        stacks.append(Stacked([
            block(10 * v + d, tp_group=tp_group, sequence_parallel=sequence_parallel, dtype=dtype,
                  weight_format=weight_format, shared_gate_up=gate_up, rms_norm=norm)
            for d in range(depth)
        ]))
    return Side(stacks)


class _StopAfterPass(Exception):
    pass


class Stop(CustomGraphPass):
    """Ends the compile where it runs (after the passes before it in a chain)."""

    def __call__(self, graph) -> None:
        raise _StopAfterPass

    def uuid(self) -> None:
        return None


# One compile thread: a pool of compile subprocesses costs more to start than it saves here.
COMPILE_OPTIONS = {"fx_graph_cache": False, "compile_threads": 1}


def post_grad(model: nn.Module, args: tuple, fusion_pass: CustomGraphPass | None) -> None:
    """Trace `model(*args)` through dynamo, AOT and post-grad up to `fusion_pass`, then stop.

    fusion_pass=None: run what `torch._inductor.config.post_grad_custom_pre_pass` holds (which must
    end the compile with a `Stop()`), as a model compiled without options would.
    """
    torch._dynamo.reset()
    options = None if fusion_pass is None else {"post_grad_custom_pre_pass": ChainedGraphPass(fusion_pass, Stop())}
    with torch._inductor.config.patch(COMPILE_OPTIONS):
        fn = torch.compile(model, options=options, dynamic=False)
        try:
            fn(*args)
        except Exception as exc:  # dynamo wraps the stop signal in its own error types
            if "_StopAfterPass" not in f"{type(exc).__name__} {exc!r} {exc.__cause__!r}":
                raise
            return
    raise AssertionError("the compile finished without reaching the post-grad pass")


def compiled(model: nn.Module, fusion_pass: CustomGraphPass | None):
    """A fully compiled model (FX graph cache off) with `fusion_pass` in the post-grad pre slot."""
    torch._dynamo.reset()
    options = {"post_grad_custom_pre_pass": fusion_pass} if fusion_pass is not None else {}
    fn = torch.compile(model, options=options, dynamic=False)

    def run(*args):
        with torch._inductor.config.patch(COMPILE_OPTIONS):
            return fn(*args)

    return run


@contextlib.contextmanager
def fake_group(world: int) -> Iterator[dist.ProcessGroup]:
    """A single-process stand-in for a `world`-rank group: collectives trace and run, results are junk."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized(), "a process group is already initialized in this process"
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm()).item()


# What the router fusion (fusion_pass/routing.py, independent of the block rewrite) removes and adds.
ROUTER_CHAIN_OPS = {
    "aten.sigmoid.default", "aten.add.Tensor", "aten.topk.default", "getitem", "aten.gather.default",
    "aten.sum.dim_IntList", "aten.div.Tensor", "aten.mul.Tensor", "prims.convert_element_type.default",
    "aten.sub.Tensor", "aten.ge.Scalar", "aten.lt.Scalar", "aten.bitwise_and.Tensor", "aten.full.default",
    "aten.where.self",
}
ROUTE = "lmf.noaux_tc_route.default"
ROUTE_AND_PROJECT = "lmf.route_and_project.default"  # a router with its GEMM, beside the down-projection
GEMM_OPS = {"aten.mm.default", "aten.mm.dtype", "aten.permute.default"}


def unchanged(report) -> bool:
    """No block rewritten: the graph is as before but for the router chains the router fusion replaced
    (with their gate GEMM and the down-projection, where they went beside it: router_overlap.py)."""
    if not report.routings:
        return report.matched == 0 and report.nodes_before == report.nodes_after and report.ops_before == report.ops_after
    added, removed = report.ops_added(), report.ops_removed()
    beside = sum(1 for r in report.routings if r.beside)
    return (report.matched == 0 and set(added) <= {ROUTE, ROUTE_AND_PROJECT, "getitem"}
            and added[ROUTE] == len(report.routings) - beside and added[ROUTE_AND_PROJECT] == beside
            and set(removed) <= ROUTER_CHAIN_OPS | GEMM_OPS
            and removed["aten.mm.default"] + removed["aten.mm.dtype"] == 2 * beside)


# -- blocks the pass must leave alone ------------------------------------------------------------
class LeakyBlock(lmf.KimiK3MoEBlock):
    """R = 1 block that also returns one intermediate, which the fused ops would not produce."""

    def __init__(self, leak: str, **kwargs) -> None:
        super().__init__(CFG, **kwargs)
        self.leak = leak

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from latent_moe_fusion.model.layers import RMS_NORMS

        y = self.routed(x)
        y_n = RMS_NORMS[self.rms_norm_form](y, self.norm_weight, self.cfg.rms_norm_eps)
        u = torch.nn.functional.linear(y_n, self.w_up)
        s = self.shared(x)
        leaked = {"routed": y, "normed": y_n, "up": u, "shared": s}[self.leak]
        return u + s, leaked


class HalfTailBlock(lmf.KimiK3MoEBlock):
    """Routed experts in bf16, everything after them (RMSNorm output, up-projection, shared expert) in float16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from latent_moe_fusion.model.layers import rms_norm_manual, situ_activation

        F = torch.nn.functional
        y_n = rms_norm_manual(self.routed(x), self.norm_weight, self.cfg.rms_norm_eps).half()
        u = F.linear(y_n, self.w_up.half())
        g, up = F.linear(x.half(), self.shared_w13.half()).chunk(2, dim=-1)
        act = situ_activation(g, up, self.cfg.situ_beta, self.cfg.situ_linear_beta)
        return u + F.linear(act, self.shared_w2.half())


class OtherBetaBlock(lmf.KimiK3MoEBlock):
    """The shared expert's SiTU uses another beta than the routed experts: one producer cannot serve both."""

    def shared(self, x_s: torch.Tensor) -> torch.Tensor:
        from latent_moe_fusion.model.layers import situ_activation

        g, u = torch.nn.functional.linear(x_s, self.shared_w13).chunk(2, dim=-1)
        return torch.nn.functional.linear(situ_activation(g, u, 2.0, self.cfg.situ_linear_beta), self.shared_w2)


class Cast(nn.Module):
    """Runs `inner` on the input cast to `dtype` (lets a float32 block sit beside bf16 ones in one graph)."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.to(self.dtype))


class TensorAndSequenceParallel(nn.Module):
    """A TP block on the full tokens and an SP block on this rank's tokens, in one graph."""

    def __init__(self, tp: nn.Module, sp: nn.Module) -> None:
        super().__init__()
        self.tp = tp
        self.sp = sp

    def forward(self, x: torch.Tensor, x_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tp(x), self.sp(x_local)


def kimi_tp_and_sp_on_gpus(group, dev: torch.device) -> TensorAndSequenceParallel:
    """The multi-GPU tests' model: Kimi K3 sizes with 64 MXFP4 experts and a 768-wide shared slice per rank, a TP
    block and an SP block over `group` (NCCL), router GEMM bf16."""
    cfg = lmf.KimiK3MoEConfig().replace(num_experts=64, shared_intermediate_size=768)
    common = dict(weight_format="mxfp4", dtype=torch.bfloat16, device=dev, router_gemm="bf16", tp_group=group)
    return TensorAndSequenceParallel(lmf.KimiK3MoEBlock(cfg, seed=1, **common),
                                     lmf.KimiK3MoEBlock(cfg, seed=2, sequence_parallel=True, **common))


def tp_and_sp_inputs(world: int, rank: int, seed: int, dev: torch.device, hidden: int):
    """(16 tokens, the same on every rank; this rank's 8 of the SP batch), drawn alike on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, hidden, generator=gen).to(dev, torch.bfloat16)
    x_local = torch.randn(world, 8, hidden, generator=gen)[rank].to(dev, torch.bfloat16)
    return x, x_local, gen


def tp_and_sp(group, dtype: torch.dtype = torch.bfloat16) -> TensorAndSequenceParallel:
    """TP: merged gate/up, F.rms_norm, bf16 weights. SP: split gate/up, manual RMSNorm, MXFP4 weights."""
    return TensorAndSequenceParallel(
        block(1, tp_group=group, dtype=dtype),
        block(2, tp_group=group, sequence_parallel=True, dtype=dtype, shared_gate_up="split", rms_norm="manual",
              weight_format="mxfp4"),
    )


class TransposedUpBlock(lmf.KimiK3MoEBlock):
    """Keeps the up-projection weight as a transposed view (non-contiguous [H, L]): latent_tail refuses it."""

    def __init__(self, **kwargs) -> None:
        super().__init__(CFG, **kwargs)
        self.w_up = nn.Parameter(self.w_up.detach().t().contiguous().t(), requires_grad=False)
