"""What the register-dequant kernels' GPU tests share: the sm_90 marks, two problem sizes, and the routed op captured
in a CUDA graph and replayed on fresh inputs."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed.expert_schedule import run_experts
from tests.expert_problems import make_problem, rel_l2, tolerance
from tests.float64_reference import routed64

SM90_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the register-dequant kernels are sm_90 only"),
]
KIMI_RANK = dict(latent=3584, inter=3072, num_experts=8, top_k=8, hidden=7168, inter_s=768)
SMALL = dict(latent=512, inter=256, num_experts=32, top_k=16, hidden=1024, inter_s=128)


def capture_routed(p) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """run_experts on p's routed arguments captured in a CUDA graph (compiled outside the capture, with the settings
    in force now), and the graph's output buffer."""
    run_experts(*p.routed_args())
    torch.cuda.synchronize()
    out = torch.full_like(p.z, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_experts(*p.routed_args(), out=out)
    return graph, out


def replay_on(graph: torch.cuda.CUDAGraph, out: torch.Tensor, p, fresh) -> None:
    """Copy fresh's tokens, ids and weights into p's (the graph's static inputs), poison the output, replay."""
    for name in ("z", "topk_ids", "topk_weights"):
        getattr(p, name).copy_(getattr(fresh, name))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def assert_replays_fresh_routings(p, fresh, run) -> None:
    """Capture the routed op on p (settings in force now), replay it on fresh(routing)'s inputs for three routings:
    each replay equals run() (the op called on p's new inputs) bit for bit and the float64 reference within BF16
    tolerance."""
    graph, out = capture_routed(p)
    for routing in ("rows", "few_experts", "random"):
        replay_on(graph, out, p, fresh(routing))
        assert torch.equal(out, run()), routing
        assert rel_l2(out, routed64(*p.routed_args())) < tolerance(torch.bfloat16), routing


def ids_with_rows(m: int, num_experts: int, top_k: int, rows: tuple[int, ...]) -> torch.Tensor:
    """ids [m, top_k] where expert e (of the first len(rows)) holds rows[e] pairs, each on another token; the other
    slots point at other ranks' experts (-1)."""
    ids = torch.full((m, top_k), -1, dtype=torch.int32)
    used = torch.zeros(m, dtype=torch.int64)
    for expert, count in enumerate(rows):
        tokens = torch.argsort(used + torch.rand(m))[:count]  # the emptiest tokens first: one slot each
        assert count <= m and bool((used[tokens] < top_k).all())
        ids[tokens, used[tokens]] = expert
        used[tokens] += 1
    assert expert < num_experts
    return ids.cuda()


def mxfp4_problem(sizes: dict, m: int, routing: str, expert_rows: dict[int, tuple[int, ...]]):
    """An MXFP4 problem on the GPU; routing "rows" gives expert e expert_rows[num_experts][e] pairs (ids_with_rows),
    any other name is make_problem's routing."""
    p = make_problem(m, weight_format="mxfp4", device="cuda", **({"routing": routing} if routing != "rows" else {}),
                     **sizes)
    if routing == "rows":
        experts = sizes["num_experts"]
        p.topk_ids.copy_(ids_with_rows(m, experts, sizes["top_k"], expert_rows[experts]))
    return p
