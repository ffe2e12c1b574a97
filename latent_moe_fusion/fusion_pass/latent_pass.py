"""LatentMoEFusionPass: the Inductor post-grad pass that fuses the Kimi K3 latent-MoE block.

Per graph: find candidates (candidates.py), check what the fused ops can serve (checks.py), then let
the pattern matcher rewrite the approved ones (matcher.py) into

    y_n, ws = lmf::moe_shared_producer(<routed args>, rms_weight, eps, x_s, w1_s, w3_s, w2_s, mode, group)
    out     = lmf::latent_tail(y_n, w_up, ws, mode, group)

and, beyond the brief (docs/design.md, section 3), the router: its chain after the gate GEMM into lmf::noaux_tc_route (routing.py),
then that route with its gate GEMM and the latent down-projection of the same tokens into
lmf::route_and_project (router_overlap.py), which runs the two side by side on CUDA, or with the block's
producer into lmf::route_and_produce, which also starts the shared expert first, and for an SP block with the
all-gather of its tokens into lmf::route_gather_and_produce, which gathers beside the router.
Everything not rewritten is reported with a reason and logged on the "latent_moe_fusion" logger.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from ..patterns import FORMS, PatternSpec
from . import mm_padding
from .cache_record import stamp
from .candidates import Candidate, find_candidates
from .capabilities import DISABLE_ENV, Capabilities, agree_capabilities
from .checks import check_candidate
from .config import FusionConfig
from .matcher import approved, matcher_for
from .reject import Reject
from .report import FusionReport, MatchedBlock, MatchedRouting, op_counts
from .router_overlap import OverlapMatch, check_overlap, drop_gather, find_overlap, rewrite_overlap
from .routing import check_routing, find_routings, rewrite_routing

log = logging.getLogger("latent_moe_fusion")
_PACKAGE = Path(__file__).resolve().parent.parent
_CODE_DIRS = ("fusion_pass", "patterns")


class LatentMoEFusionPass(CustomGraphPass):
    """Rewrites every fusable latent-MoE block of a post-grad graph into producer + tail.

    Build it on every rank of the group (default: the world group) at the same point: construction
    agrees the capabilities that matter across ranks (one all_gather_object). `report` describes
    the last graph the pass ran on; `reports` keeps one per graph.
    """

    def __init__(self, config: FusionConfig | None = None, *, group: dist.ProcessGroup | None = None) -> None:
        self.config = config if config is not None else FusionConfig()
        self.capabilities: Capabilities = agree_capabilities(group)
        self.report = FusionReport()
        self.reports: list[FusionReport] = []

    @property
    def enabled(self) -> bool:
        return not self.capabilities.disabled

    # -- the pass ----------------------------------------------------------------------------
    def __call__(self, graph: fx.Graph) -> None:
        report = FusionReport(nodes_before=len(graph.nodes), ops_before=op_counts(graph))
        padded = mm_padding.expose(graph)  # matmuls Inductor padded, seen as plain ones (mm_padding.py)
        candidates = find_candidates(graph, self.config)
        accepted = self._decide(candidates, report)
        if accepted:
            self._rewrite(graph, accepted)
        report.unpadded_matmuls = mm_padding.settle(graph, padded)
        if self.config.fuse_routing:
            self._fuse_routing(graph, report)
        if accepted or padded or report.routings:
            graph.lint()
        remaining = set(graph.nodes)
        for cand in accepted.values():
            if cand.routed in remaining:
                self._reject(report, cand, cand.gate_reason or _unmatched_reason(cand))
            else:
                report.blocks.append(self._matched_block(cand))
                log.info("latent_moe_fusion: fused %s as %s (%s)", cand.where, cand.form, cand.spec.variant)
        report.matched = len(report.blocks)
        report.nodes_after = len(graph.nodes)
        report.ops_after = op_counts(graph)
        self.report = report
        self.reports.append(report)
        stamp(report)  # so that a compile served from the FX graph cache can still tell (cache_record.py)

    def _decide(self, candidates: list[Candidate], report: FusionReport) -> dict[fx.Node, Candidate]:
        accepted = {}
        for cand in candidates:
            if cand.reason is None and not self.enabled:
                cand.reason = f"{DISABLE_ENV}=1 on at least one rank: fusion is switched off"
            if cand.reason is None:
                try:
                    cand.backends = check_candidate(cand, self.config, self.capabilities)
                except Reject as exc:
                    cand.reason = str(exc)
                except Exception as exc:  # fail closed on anything unexpected
                    cand.reason = f"could not check the block ({type(exc).__name__}: {exc})"
            if cand.reason is None:
                accepted[cand.routed] = cand
            else:
                self._reject(report, cand, cand.reason)
        return accepted

    def _fuse_routing(self, graph: fx.Graph, report: FusionReport) -> None:
        """Router chains into lmf::noaux_tc_route (routing.py); independent of the block rewrite, whose
        patterns take the ids and weights from any producer."""
        for match in find_routings(graph):
            if match.reason is None and not self.enabled:
                match.reason = f"{DISABLE_ENV}=1 on at least one rank: fusion is switched off"
            route = None
            if match.reason is None:
                try:
                    match.backend = check_routing(match, self.config, self.capabilities)
                    route = rewrite_routing(graph, match)
                except Reject as exc:
                    match.reason = str(exc)
                except Exception as exc:  # fail closed: the rewrite runs only after every check passed
                    match.reason = f"could not fuse the router ({type(exc).__name__}: {exc})"
            if match.reason is None:
                beside, beside_reason, overlap = (self._overlap_router(graph, route) if self.config.overlap_router
                                                  else (None, None, None))
                with_producer = overlap is not None and overlap.with_producer
                gathers = overlap is not None and overlap.gather is not None
                gather_reason = overlap.gather_reason if overlap is not None and beside else None
                report.routings.append(MatchedRouting(match.where, match.top_k, match.localized, match.backend,
                                                      beside, beside_reason, with_producer, match.share_reason,
                                                      gathers, gather_reason))
                log.info("latent_moe_fusion: fused the router %s (%s)%s%s", match.where, match.backend,
                         f", beside the down-projection ({beside})" if beside else f"; alone: {beside_reason}",
                         f"; SP tokens gathered before the op: {gather_reason}" if gather_reason else "")
            else:
                report.routing_rejected.append((match.where, match.reason))
                # INFO, not WARNING: every aten.topk is examined, and most in a model are no router
                log.info("latent_moe_fusion: left the router %s unfused: %s", match.where, match.reason)

    def _overlap_router(self, graph: fx.Graph, route: fx.Node) -> tuple[str | None, str | None, OverlapMatch]:
        """(what went into lmf::route_and_project, lmf::route_and_produce or lmf::route_gather_and_produce, None,
        the match: whether the producer and the gather went in too) or (None, why the router stays alone, the
        match)."""
        match = find_overlap(graph, route, self.config.shared_first, self.config.gather_tokens)
        if match.reason is not None:
            return None, match.reason, match
        try:
            try:
                backend = check_overlap(match, self.config, self.capabilities)
            except Reject as exc:
                if match.gather is None:
                    raise
                drop_gather(match, f"lmf::route_gather_and_produce refused it: {exc}")  # fail closed to today's op
                backend = check_overlap(match, self.config, self.capabilities)
            where = (f"{match.where} + {match.consumer.name}" if match.with_producer else match.where) + (
                f" + {match.gather[0].name}" if match.gather is not None else "")
            rewrite_overlap(graph, match)
        except Reject as exc:
            return None, str(exc), match
        except Exception as exc:  # fail closed: the rewrite runs only after every check passed
            return None, f"could not put the router beside the down-projection ({type(exc).__name__}: {exc})", match
        return f"{where} [{backend}]", None, match

    def _rewrite(self, graph: fx.Graph, accepted: dict[fx.Node, Candidate]) -> None:
        """Apply only the specs the candidates need: their form, dtype, weights, group and gate/up form,
        the RMSNorm form the walk guessed first, the other RMSNorm forms only for blocks still unmatched
        (every spec costs a trace to register and two per match)."""
        pending = dict(accepted)
        with approved(accepted):
            for attempt in range(len(self.config.norm_forms)):
                specs = []
                for cand in pending.values():
                    norms = sorted(self.config.norm_forms, key=lambda n: n != cand.norm_hint)
                    spec = PatternSpec(FORMS[cand.form], cand.gate_up, norms[attempt], cand.routed.meta["val"].dtype,
                                       cand.routed.args[7], cand.group_name, cand.world)
                    if spec not in specs:
                        specs.append(spec)
                for spec in specs:
                    try:
                        matcher_for(spec).apply(graph)
                    except Exception as exc:  # a match is applied only once fully traced: the graph stays valid
                        for cand in pending.values():
                            cand.gate_reason = cand.gate_reason or f"pattern matcher failed ({type(exc).__name__}: {exc})"
                remaining = set(graph.nodes)
                pending = {routed: cand for routed, cand in pending.items() if routed in remaining}
                if not pending:
                    return

    def _reject(self, report: FusionReport, cand: Candidate, reason: str) -> None:
        report.rejected.append((cand.where, reason))
        level = logging.INFO if not self.enabled else logging.WARNING
        log.log(level, "latent_moe_fusion: left %s unfused: %s", cand.where, reason)

    @staticmethod
    def _matched_block(cand: Candidate) -> MatchedBlock:
        backends = ", ".join(f"{op}={name}" for op, name in (cand.backends or {}).items())
        return MatchedBlock(cand.where, cand.form, FORMS[cand.form].mode, f"{cand.spec.variant}; {backends}",
                            cand.group_name)

    # -- caching -----------------------------------------------------------------------------
    def uuid(self) -> str:
        """Code of the pass and patterns, pattern set, configuration, agreed capabilities, switch."""
        h = hashlib.sha256()
        h.update(_code_digest().encode())
        h.update(repr(self.config).encode())
        h.update("\n".join(self.config.pattern_set()).encode())
        h.update(self.capabilities.key().encode())
        h.update(f"enabled={self.enabled}".encode())
        h.update(torch.__version__.encode())
        return h.hexdigest()


def _unmatched_reason(cand: Candidate) -> str:
    return (
        f"no registered pattern matched this {cand.form} block ({cand.gate_up} gate/up): it is written differently "
        "from the merged/split gate-up, plain-torch SiTU, F.rms_norm/manual-float32 RMSNorm and u + s forms, or its "
        f"SiTU betas differ from the routed op's; TORCHINDUCTOR_PATTERN_MATCH_DEBUG={cand.out.name} shows where"
    )


_CODE_DIGEST: str | None = None


def _code_digest() -> str:
    global _CODE_DIGEST
    if _CODE_DIGEST is None:
        h = hashlib.sha256()
        for directory in _CODE_DIRS:
            for path in sorted((_PACKAGE / directory).glob("*.py")):
                h.update(path.name.encode())
                h.update(path.read_bytes())
        _CODE_DIGEST = h.hexdigest()
    return _CODE_DIGEST
