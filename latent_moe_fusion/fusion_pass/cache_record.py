"""What a compile served, FX graph cache hits included: `record_fusion()`.

A graph served from Inductor's FX graph cache is never given to the post-grad passes, so a pass built in that
process reports nothing, although the graph it is served is fused. Inductor does carry one thing of a compile
through its cache: the change it made to the `inductor` counters, which is stored with the compiled graph and
added again on every hit (codecache's cache_hit_post_compile). The pass stamps its report there, as one counter
key holding the report; `record_fusion()` reads back every stamp added while it is open, whether the pass
wrote it just now or the cache replayed it, and tells the two apart by what the pass wrote in this process.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from torch._dynamo.utils import counters

from .report import FusionReport

_PREFIX = "latent_moe_fusion.report:"
_STAMPED_HERE: Counter = Counter()  # stamps the pass wrote in this process (the rest came from the cache)


def stamp(report: FusionReport) -> None:
    """Record `report` in Inductor's counters, where a cached compile of this graph will bring it back."""
    key = _PREFIX + report.to_json()
    counters["inductor"][key] += 1
    _STAMPED_HERE[key] += 1


def _stamps() -> Counter:
    return Counter({k: n for k, n in counters["inductor"].items() if k.startswith(_PREFIX)})


@dataclass
class FusionRecord:
    """The fusion reports of every graph compiled or served from the FX graph cache inside `record_fusion()`."""

    reports: list[FusionReport] = field(default_factory=list)

    @property
    def matched(self) -> int:
        return sum(r.matched for r in self.reports)

    @property
    def cache_hits(self) -> int:
        return sum(r.from_cache for r in self.reports)

    def lmf_ops(self) -> Counter:
        """lmf ops in the graphs served (op name -> count)."""
        return sum((Counter({k: n for k, n in r.ops_after.items() if k.startswith("lmf.")}) for r in self.reports),
                   Counter())

    def summary(self) -> str:
        if not self.reports:
            return ("latent-moe fusion: no graph was compiled or served with the fusion pass installed here "
                    "(compiled earlier in this process, or the pass is not installed)")
        return "\n".join(r.summary() for r in self.reports)


@contextlib.contextmanager
def record_fusion() -> Iterator[FusionRecord]:
    """Collect the fusion report of every graph compiled inside the block, FX graph cache hits included.

        with lmf.record_fusion() as record:
            out = compiled(x)  # the first call compiles, or loads from Inductor's caches
        print(record.summary())
    """
    record = FusionRecord()
    before, here_before = _stamps(), Counter(_STAMPED_HERE)
    try:
        yield record
    finally:
        added, here = _stamps() - before, _STAMPED_HERE - here_before
        for key, count in added.items():
            report = FusionReport.from_json(key[len(_PREFIX):])
            ran = min(count, here[key])
            record.reports += [report] * ran + [replace(report, from_cache=True)] * (count - ran)
