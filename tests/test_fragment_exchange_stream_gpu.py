"""Where the symmetric fragment exchange runs (fragment_layouts.start_publish), on one GPU.

The exchange must run on its own stream, forked from the caller's, so that the caller's stream goes on with the
routed experts (at prefill the shared GEMMs and the publication are in line on it), and the caller's stream must
wait for it only in wait(). Checked with rank 0 of a stand-in two-rank group (one process, torch's fake backend)
whose workspace is two buffers of this GPU and whose barriers are no-ops (no peer runs: the peer's slot is not
checked, rank 0's own slot is, bitwise): the stream each exchange step ran on, the caller's stream free while the
exchange stream is held, and the same inside a captured CUDA graph replayed on fresh data.
"""

import pytest
import torch

from latent_moe_fusion.ops.common import fragment_layouts as layouts
from latent_moe_fusion.ops.common import symm_exchange
from latent_moe_fusion.ops.common.side_streams import side_stream
from latent_moe_fusion.ops.common.symm_exchange import SymmetricExchange
from tests.exchange_helpers import BufferHandle, workspace_sizes
from tests.fusion_models import fake_group

pytestmark = pytest.mark.gpu

HIDDEN, TOKENS = 1024, 64


def _stand_in(group_name: str, dev: torch.device) -> SymmetricExchange:
    fragment_bytes, output_bytes, total = workspace_sizes(2, TOKENS, HIDDEN)
    buffers = [torch.zeros(total, dtype=torch.uint8, device=dev) for _ in range(2)]
    return SymmetricExchange(group_name, 2, 0, dev, TOKENS, HIDDEN, "on", buffers[0], BufferHandle(buffers, lambda: None),
                             fragment_bytes, output_bytes, method="copies")


def test_the_exchange_runs_on_its_own_stream_beside_the_callers():
    dev = torch.device("cuda", torch.cuda.current_device())
    with fake_group(2) as group:
        exchange = _stand_in(group.group_name, dev)
        streams = []
        real = exchange._exchange

        def recording(kind, parts):
            streams.append(torch.cuda.current_stream(dev))
            return real(kind, parts)

        exchange._exchange = recording
        symm_exchange._EXCHANGES[group.group_name] = exchange
        try:
            s = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
            caller = torch.cuda.current_stream(dev)
            exchange_stream = side_stream(dev, "fragment_exchange")
            # A first publication loads its kernels (lazy module loading may wait for the device): not timed.
            layouts.start_publish(s, "hidden_scatter", group.group_name).wait()
            torch.cuda.synchronize()
            streams.clear()
            with torch.cuda.stream(exchange_stream):  # holds the exchange back (a stand-in for a late peer)
                torch.cuda._sleep(400_000_000)  # ~0.2 s
            pending = layouts.start_publish(s, "hidden_scatter", group.group_name)
            assert streams == [exchange_stream] and exchange_stream != caller
            # What the caller queues next finishes while the exchange has not run: the caller does not wait for it.
            marker = torch.cuda.Event()
            marker.record(caller)
            marker.synchronize()
            assert not pending.done.query(), "the exchange ran before the caller's next work finished"
            ws = pending.wait()
            torch.cuda.synchronize()
            assert torch.equal(ws[0], s[:, : HIDDEN // 2])  # rank 0's own slot: its own columns

            # Captured: the fork and join are graph edges; replays redo the exchange on fresh data.
            static_s = s.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_ws = layouts.publish_fragments(static_s, "hidden_scatter", group.group_name)
            for _ in range(3):
                fresh = torch.randn(TOKENS, HIDDEN, device=dev, dtype=torch.bfloat16)
                static_s.copy_(fresh)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(static_ws[0], fresh[:, : HIDDEN // 2])
        finally:
            symm_exchange.release_symmetric_exchange(group.group_name)
