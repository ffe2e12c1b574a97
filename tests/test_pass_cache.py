"""uuid(), lmf.install(), and the FX graph cache: a cached graph never crosses the enable switch."""

import shutil
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import latent_moe_fusion as lmf
from latent_moe_fusion.fusion_pass import ChainedGraphPass, FusionConfig, latent_pass
from latent_moe_fusion.ops.common import backends
from latent_moe_fusion.ops.common.backends import Backend, register_backend
from latent_moe_fusion.ops.routed.expert_reference import producer_reference
from tests.fusion_models import CFG, Stop, block, post_grad

BF16 = torch.bfloat16


def test_uuid_covers_switch_configuration_and_pattern_set(monkeypatch):
    monkeypatch.delenv("LMF_DISABLE_FUSION", raising=False)
    base = lmf.LatentMoEFusionPass().uuid()
    assert lmf.LatentMoEFusionPass().uuid() == base  # deterministic
    monkeypatch.setenv("LMF_DISABLE_FUSION", "1")
    switched_off = lmf.LatentMoEFusionPass().uuid()
    monkeypatch.delenv("LMF_DISABLE_FUSION")
    variants = [
        FusionConfig(forms=("local",)),
        FusionConfig(gate_up_forms=("split",)),
        FusionConfig(norm_forms=("manual",)),
        FusionConfig(dtypes=("bfloat16",)),
        FusionConfig(weight_formats=("mxfp4",)),
        FusionConfig(reference_backend_devices=()),
    ]
    uuids = [base, switched_off] + [lmf.LatentMoEFusionPass(c).uuid() for c in variants]
    assert len(set(uuids)) == len(uuids)
    assert lmf.LatentMoEFusionPass().uuid() == base  # switch back on: same key as before


def test_uuid_covers_the_pass_and_pattern_code(tmp_path, monkeypatch):
    package = Path(latent_pass.__file__).resolve().parent.parent
    copy = tmp_path / "pkg"
    for sub in latent_pass._CODE_DIRS:
        shutil.copytree(package / sub, copy / sub)
    monkeypatch.setattr(latent_pass, "_PACKAGE", copy)
    monkeypatch.setattr(latent_pass, "_CODE_DIGEST", None)
    same = latent_pass._code_digest()
    (copy / "patterns" / "local.py").write_text((copy / "patterns" / "local.py").read_text() + "\n# changed\n")
    monkeypatch.setattr(latent_pass, "_CODE_DIGEST", None)
    assert latent_pass._code_digest() != same


class _Marker(CustomGraphPass):
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, graph) -> None:
        self.calls += 1

    def uuid(self) -> str:
        return "marker"


def test_install_chains_an_existing_pass_and_replaces_an_earlier_fusion_pass():
    marker = _Marker()
    with torch._inductor.config.patch(post_grad_custom_pre_pass=None):
        first = lmf.install()
        assert torch._inductor.config.post_grad_custom_pre_pass is first
        torch._inductor.config.post_grad_custom_pre_pass = marker
        second = lmf.install()
        chain = torch._inductor.config.post_grad_custom_pre_pass
        assert isinstance(chain, ChainedGraphPass) and chain.passes == (marker, second)
        third = lmf.install(lmf.LatentMoEFusionPass())
        assert torch._inductor.config.post_grad_custom_pre_pass.passes == (marker, third)
        assert torch._inductor.config.post_grad_custom_pre_pass.uuid() == (("_Marker", "marker"),
                                                                           ("LatentMoEFusionPass", third.uuid()))
        # The globally installed chain is what Inductor runs: stop right after it.
        torch._inductor.config.post_grad_custom_pre_pass = ChainedGraphPass(marker, third, Stop())
        post_grad(block(1, dtype=BF16), (torch.randn(8, CFG.hidden_size, dtype=BF16),), None)
    assert marker.calls == 1 and third.report.matched == 1
    opaque = ChainedGraphPass(lambda graph: None, third)
    assert opaque.uuid() is None  # a member without uuid: Inductor must bypass its cache


class _CountingProducer:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return producer_reference(*args)


def test_fx_graph_cache_never_serves_the_other_switch_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("LMF_DISABLE_FUSION", raising=False)
    counting = _CountingProducer()
    monkeypatch.setitem(backends._REGISTRY, "moe_shared_producer", backends.backends_for("moe_shared_producer"))
    register_backend(Backend("moe_shared_producer", "test-counting", 0, ("cpu",), counting))
    model = block(1, dtype=BF16)
    x = torch.randn(8, CFG.hidden_size, dtype=BF16)

    def producer_calls_of_a_fresh_compile(switch_off: bool) -> int:
        if switch_off:
            monkeypatch.setenv("LMF_DISABLE_FUSION", "1")
        fusion_pass = lmf.LatentMoEFusionPass()
        monkeypatch.delenv("LMF_DISABLE_FUSION", raising=False)
        torch._dynamo.reset()
        before = counting.calls
        with torch._inductor.config.patch(fx_graph_cache=True, compile_threads=1):
            torch.compile(model, options={"post_grad_custom_pre_pass": fusion_pass}, dynamic=False)(x)
        return counting.calls - before

    def hits() -> int:
        return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]

    assert producer_calls_of_a_fresh_compile(switch_off=False) == 1  # cold: fused graph compiled and cached
    assert producer_calls_of_a_fresh_compile(switch_off=True) == 0  # must not be served the fused graph
    hits_before = hits()
    assert producer_calls_of_a_fresh_compile(switch_off=False) == 1
    assert producer_calls_of_a_fresh_compile(switch_off=True) == 0
    assert hits() >= hits_before + 2, "the cache was not hit: this test checked nothing"


def _child(cache_dir: Path) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    env.pop("LMF_DISABLE_FUSION", None)
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "tests.fx_cache_child"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_process_served_from_the_fx_graph_cache_still_learns_what_its_graph_holds(tmp_path):
    """Two processes, one cache directory: the second is served the fused graph without running the pass, and
    record_fusion() still reports the fused block (the report of the compile that made it) as a cache hit."""
    first = _child(tmp_path / "inductor")
    second = _child(tmp_path / "inductor")
    assert first["pass_runs"] >= 1 and first["cache_hits"] == 0 and first["matched"] == 1, first
    assert second["inductor_hits"] >= 1, "the cache was not hit: this test checked nothing"
    assert second["pass_runs"] == 0, second  # the pass did not run: the graph came from the cache
    assert second["cache_hits"] >= 1 and second["matched"] == 1, second
    assert second["lmf_ops"] == first["lmf_ops"] and any("latent_tail" in op for op in second["lmf_ops"]), second
    assert "served from Inductor's FX graph cache" in second["summary"]
    assert first["finite"] and second["finite"]
