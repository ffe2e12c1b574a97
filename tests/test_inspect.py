"""Graph dumps: the inspect CLI's before/after/summary, and a depyf dump of a fused TP + SP graph."""

from pathlib import Path

import pytest
import torch

import latent_moe_fusion as lmf
from latent_moe_fusion.__main__ import main
from tests.fusion_models import CFG, compiled, fake_group, tp_and_sp


def test_inspect_cli_prints_graphs_before_and_after_and_a_summary(capsys):
    assert main(["inspect", "--tp", "2", "--sp", "--gate-up", "split", "--rms-norm", "manual"]) == 0
    out = capsys.readouterr().out
    before, rest = out.split("post-grad graph after the fusion pass")
    after, summary = rest.split("= summary =")
    assert "reduce_scatter_tensor" in before and "lmf.moe_shared_producer" not in before
    # the SP block's producer with the router, the down-projection and the tokens' all-gather that feed it
    assert "lmf.route_gather_and_produce.default" in after and "all_gather_into_tensor" not in after
    assert "lmf.latent_tail.default" in after
    assert "reduce_scatter_tensor" not in after and "'token_publish'" in after
    assert "1 block(s) rewritten" in summary and "ops removed:" in summary and "ops added:" in summary
    assert "_c10d_functional.reduce_scatter_tensor.default x1" in summary


def test_depyf_dump_holds_the_fused_ops_and_no_shared_collectives(tmp_path):
    depyf = pytest.importorskip("depyf")
    x = torch.randn(16, CFG.hidden_size, dtype=torch.bfloat16)
    with fake_group(2) as group:
        fusion_pass = lmf.LatentMoEFusionPass()
        run = compiled(tp_and_sp(group), fusion_pass)
        with depyf.prepare_debug(str(tmp_path)):
            run(x, x[:8].contiguous())
    assert fusion_pass.report.matched == 2
    dumps = {p.name: p.read_text() for p in Path(tmp_path).glob("*.py")}
    after = [text for name, text in dumps.items() if "AFTER_POST_GRAD" in name or ".kernel_" in name]
    assert len(after) >= 2, sorted(dumps)
    for text in after:
        producers = (text.count("torch.ops.lmf.moe_shared_producer.default(")
                     + text.count("torch.ops.lmf.route_and_produce.default("))
        assert producers == 1 and text.count("torch.ops.lmf.route_gather_and_produce.default(") == 1  # TP, SP
        assert text.count("torch.ops.lmf.latent_tail.default(") == 2
        assert "all_reduce" not in text and "reduce_scatter" not in text
    before = [text for name, text in dumps.items() if "BEFORE_PRE_GRAD" in name]
    assert before and "all_reduce" in before[0] and "reduce_scatter" in before[0]
