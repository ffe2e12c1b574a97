"""The one-launch exchange kernel (ops/common/peer_exchange.py) compiled for a real GPU, on one GPU.

R ranks are R SymmetricExchange objects in this process over R plain device buffers (every "peer" mapping is the
buffer itself), each rank's kernel on its own stream, all launched before any is waited for: they run at the same
time and meet through the flags, as on R GPUs (there over NVLink, tests/test_symm_exchange_gpu.py). Checked
bitwise against docs/design.md's layouts, over exchanges of changing shapes and many in a row without a host sync.
"""

import pytest
import torch

from latent_moe_fusion.ops.common.symm_exchange import SymmetricExchange, flag_bytes, region_sizes
from tests.exchange_helpers import BufferHandle, dense_fragments

pytestmark = pytest.mark.gpu

HIDDEN = 7168


def _ranks(world: int, max_tokens: int) -> list[SymmetricExchange]:
    fragment_bytes, output_bytes = region_sizes(world, max_tokens, HIDDEN, 2)
    total = fragment_bytes + output_bytes + flag_bytes(world)
    buffers = [torch.full((total,), 0xFF, dtype=torch.uint8, device="cuda") for _ in range(world)]
    for buffer in buffers:
        buffer[fragment_bytes + output_bytes:] = 0
    handle = BufferHandle(buffers)
    return [SymmetricExchange("g", world, rank, torch.device("cuda", torch.cuda.current_device()), max_tokens, HIDDEN,
                              "on", buffers[rank], handle, fragment_bytes, output_bytes, method="kernel",
                              max_programs=16, fragment_programs=8)
            for rank in range(world)]


def _concurrently(world: int, fn) -> list:
    """fn(rank) for every rank, each on its own stream, launched before any is waited for."""
    streams = [torch.cuda.Stream() for _ in range(world)]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    results = []
    for rank, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            results.append(fn(rank))
    for stream in streams:
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_kernel_exchanges_on_one_gpu_are_the_layouts_bitwise(world):
    ranks = _ranks(world, 256)
    for mode in ("hidden_scatter", "token_publish"):
        for tokens in (256, 1, 8, 130, 3):
            m_s = tokens if mode == "hidden_scatter" else tokens * world
            partials = [torch.randn(m_s, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(world)]
            shape = (world, tokens, HIDDEN // world) if mode == "hidden_scatter" else (tokens, world, HIDDEN)
            outs = _concurrently(world, lambda rank, p=partials, s=shape: ranks[rank].publish(
                p[rank], mode, torch.full(s, float("nan"), dtype=torch.bfloat16, device="cuda")))
            for rank, ws in enumerate(outs):
                assert torch.equal(ws, dense_fragments(partials, mode, rank)), (mode, tokens, rank)
    for tokens in (128, 2):
        slices = [torch.randn(tokens, HIDDEN // world, device="cuda").to(torch.bfloat16) for _ in range(world)]
        for out in _concurrently(world, lambda rank, s=slices: ranks[rank].gather_columns(s[rank])):
            assert torch.equal(out, torch.cat(slices, dim=1)), tokens


def test_many_exchanges_in_a_row_without_a_host_sync():
    world = 2
    ranks = _ranks(world, 64)
    width = HIDDEN // world

    def run(rank: int) -> list[torch.Tensor]:
        return [ranks[rank].gather_columns(torch.full((8, width), float(i * world + rank), device="cuda"))
                for i in range(200)]

    for outs in _concurrently(world, run):
        for i, out in enumerate(outs):
            expected = torch.arange(world, dtype=torch.float32, device="cuda").repeat_interleave(width) + i * world
            assert torch.equal(out, expected.expand(8, -1)), i
    for exchange in ranks:  # every flag back at rest
        assert not bool(exchange.buffer[exchange.fragment_bytes + exchange.output_bytes:].any())
