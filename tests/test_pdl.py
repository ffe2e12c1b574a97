"""ops/common/pdl.py: which launches go out as programmatic dependents (the pdl_sites tuning override), and never on the
CPU."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.common import pdl


@pytest.mark.parametrize("value, sites", [
    (None, pdl.DEFAULT_SITES), ("all", set(pdl.PDL_SITES)), ("1", set(pdl.PDL_SITES)), ("none", set()), ("0", set()),
    ("", set()), ("tail", {"tail"}), (" routed , tail ", {"routed", "tail"}), ("TAIL", {"tail"}),
])
def test_sites_from_the_override(tuned, value, sites):
    tuned(pdl_sites=value)
    assert pdl.enabled_sites() == frozenset(sites)


def test_unknown_site_names_the_choices(tuned):
    with pytest.raises(ValueError, match=r"pdl_sites='tail,combine': unknown site\(s\) combine; expected a comma list of tail, routed"):
        tuned(pdl_sites="tail,combine")
    with pytest.raises(ValueError, match="unknown PDL site 'producer'"):
        pdl.use_pdl("producer", torch.device("cpu"))


def test_never_on_the_cpu_or_under_the_interpreter(monkeypatch, tuned):
    tuned(pdl_sites="all")
    assert not pdl.use_pdl("tail", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.device_supports_pdl(torch.device("cuda", 0))


def test_tail_prefetch_depth_and_where_it_cannot_apply(tuned):
    from latent_moe_fusion.ops.common.tail_gemm import tail_launch as tail

    w = torch.randn(64, 256, dtype=torch.bfloat16)
    assert tail._prefetch_steps(w, 256, 128) == tail.TAIL_PREFETCH_STEPS
    assert tail._prefetch_steps(w, 200, 128) == 0  # a K tail: the prefetch could run past a row
    assert tail._prefetch_steps(w.t(), 64, 16) == 0  # rows not contiguous along K
    tuned(tail_prefetch="7")
    assert tail._prefetch_steps(w, 256, 128) == 7
    with pytest.raises(ValueError, match="tail_prefetch='-1': expected a count of K steps >= 0"):
        tuned(tail_prefetch="-1")
