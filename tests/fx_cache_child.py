"""One process of the FX-graph-cache test (test_pass_cache.py): compiles the tiny block with the pass installed,
Inductor's FX graph cache on (TORCHINDUCTOR_CACHE_DIR from the parent), and prints what it learnt as JSON."""

import json

import torch
from torch._dynamo.utils import counters

import latent_moe_fusion as lmf
from tests.fusion_models import CFG, block


def main() -> None:
    model = block(1, dtype=torch.bfloat16)
    x = torch.randn(8, CFG.hidden_size, dtype=torch.bfloat16)
    fusion = lmf.install()
    with torch._inductor.config.patch(fx_graph_cache=True, compile_threads=1), lmf.record_fusion() as record:
        out = torch.compile(model, dynamic=False)(x)
    print(json.dumps({
        "pass_runs": len(fusion.reports),
        "matched": record.matched,
        "cache_hits": record.cache_hits,
        "lmf_ops": dict(record.lmf_ops()),
        "summary": record.summary(),
        "inductor_hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"],
        "finite": bool(torch.isfinite(out).all()),
    }))


if __name__ == "__main__":
    main()
