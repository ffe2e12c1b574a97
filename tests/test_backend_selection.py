"""backends.select_backend: priority order, forcing, stopping at the first backend that can run, and
naming every backend's reason when none can."""

from __future__ import annotations

import pytest

from latent_moe_fusion.ops.common import backends
from latent_moe_fusion.ops.common.backends import Backend, register_backend, select_backend

OP = "test_only_op"


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(backends, "_REGISTRY", {})
    monkeypatch.delenv(f"LMF_BACKEND_{OP.upper()}", raising=False)
    monkeypatch.delenv("LMF_BACKEND", raising=False)
    asked = []

    def add(name, priority, reason):
        def supports(*args):
            asked.append(name)
            return reason

        register_backend(Backend(OP, name, priority, ("cuda", "cpu"), fn=lambda: name, supports=supports))

    return add, asked


def test_first_able_backend_wins_and_later_ones_are_not_asked(registry):
    add, asked = registry
    add("fast", 1, "too big")
    add("good", 5, None)
    add("slow", 9, None)
    assert select_backend(OP, "cpu").name == "good"
    assert asked == ["fast", "good"]


def test_forced_backend_is_used_or_refused_with_its_reason(registry, monkeypatch):
    add, _ = registry
    add("fast", 1, None)
    add("picky", 5, "only fp32")
    monkeypatch.setenv("LMF_BACKEND", "picky")
    with pytest.raises(RuntimeError, match="'picky' was forced .* only fp32"):
        select_backend(OP, "cpu")
    # a backend of another op only: this op selects as usual
    register_backend(Backend("test_only_other_op", "elsewhere", 1, ("cpu",), fn=lambda: None))
    monkeypatch.setenv("LMF_BACKEND", "elsewhere")
    assert select_backend(OP, "cpu").name == "fast"


def test_a_forced_name_no_backend_answers_to_raises(registry, monkeypatch):
    add, _ = registry
    add("fast", 1, None)
    add("picky", 5, None)
    monkeypatch.setenv("LMF_BACKEND", "fsat")
    with pytest.raises(ValueError, match=r"LMF_BACKEND='fsat' names no backend of any lmf op: expected one of fast, picky"):
        select_backend(OP, "cpu")
    monkeypatch.delenv("LMF_BACKEND")
    monkeypatch.setenv(f"LMF_BACKEND_{OP.upper()}", "elsewhere")
    with pytest.raises(ValueError, match=rf"LMF_BACKEND_{OP.upper()}='elsewhere' names no backend of lmf::{OP}: "
                                         "expected one of fast, picky"):
        select_backend(OP, "cpu")
    monkeypatch.setenv(f"LMF_BACKEND_{OP.upper()}", "picky")  # the per-op name wins over LMF_BACKEND
    monkeypatch.setenv("LMF_BACKEND", "fsat")
    assert select_backend(OP, "cpu").name == "picky"


def test_no_able_backend_names_every_reason(registry):
    add, _ = registry
    add("a", 1, "reason A")
    add("b", 2, "reason B")
    with pytest.raises(RuntimeError, match="a: reason A; b: reason B"):
        select_backend(OP, "cpu")
    with pytest.raises(RuntimeError, match="runs on"):
        select_backend(OP, "mps")
