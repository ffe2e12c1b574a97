"""Rank agreement of the DeepGEMM probe over a real gloo group (R = 2): the conservative answer,
the same on every rank, naming the rank that lacked it."""

from __future__ import annotations

import torch.distributed as dist

from tests.gloo import run_gloo

SM90, SM100 = "sm90_grouped", "sm100_mega_bf16_shared"


def _worker(rank: int, world: int):
    from latent_moe_fusion.ops.routed import deepgemm
    from latent_moe_fusion.ops.routed.deepgemm import agree, probe
    from latent_moe_fusion.ops.routed.deepgemm.probe import DeepGemmProbe

    def local(apis, reason=""):
        return DeepGemmProbe(bool(apis), reason, (10, 0), frozenset(apis), "x")

    cases = {
        "both_have_all": [local({SM90, SM100}), local({SM90, SM100})],
        "rank1_lacks_mega": [local({SM90, SM100}), local({SM90}, "fp8_fp4_mega_moe_bf16_shared_sp_rs is missing")],
        "rank0_absent": [local(set(), "deep_gemm is not installed"), local({SM100})],
    }
    out = {}
    for name, per_rank in cases.items():
        got = agree.agree_probe(per_rank[rank], dist.group.WORLD)
        out[name] = (got.available, sorted(got.apis), got.reason)
    # The process-wide path: probe (here: a planted local answer), agree, remember, report.
    deepgemm.reset_deepgemm_state()
    probe._CACHE["probe"] = cases["rank1_lacks_mega"][rank]
    agreed = deepgemm.agree_deepgemm(dist.group.WORLD)
    name = dist.group.WORLD.group_name
    out["remembered"] = (agree.agreed_for(name) == agreed, sorted(agree.current_answer().apis))
    out["status"] = deepgemm.deepgemm_status()
    deepgemm.reset_deepgemm_state()
    return out


def test_agreement_over_gloo():
    results = run_gloo(_worker, world_size=2)
    for rank in (0, 1):
        got = results[rank]
        assert got["both_have_all"][:2] == (True, sorted([SM90, SM100]))
        assert got["rank1_lacks_mega"][:2] == (True, [SM90])
        assert "sm100_mega_bf16_shared missing on rank 1" in got["rank1_lacks_mega"][2]
        assert got["rank0_absent"][:2] == (False, [])
        assert "missing on rank 0" in got["rank0_absent"][2]
        assert got["remembered"] == (True, [SM90])
        assert "missing on rank 1" in got["status"]
    # The lacking rank also says why, in its own words.
    assert "sp_rs is missing" in results[1]["rank1_lacks_mega"][2]
    for case in ("both_have_all", "rank1_lacks_mega", "rank0_absent"):
        assert results[0][case][:2] == results[1][case][:2]  # identical decision on every rank
