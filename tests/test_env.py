"""ops/common/env_switches.py: the per-call environment switches accept their words, treat empty as unset, and refuse
anything else naming the variable and what it accepts."""

import pytest

from latent_moe_fusion.ops.common.env_switches import env_choice, env_permutation, env_switch

NAME = "LMF_TEST_KNOB"


def test_choice(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_choice(NAME, ("a", "b")) is None
    monkeypatch.setenv(NAME, "")
    assert env_choice(NAME, ("a", "b")) is None
    monkeypatch.setenv(NAME, "b")
    assert env_choice(NAME, ("a", "b")) == "b"
    monkeypatch.setenv(NAME, "c")
    with pytest.raises(ValueError, match=r"LMF_TEST_KNOB='c': expected one of a, b \(which one\) or unset"):
        env_choice(NAME, ("a", "b"), "which one")


def test_switch(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_switch(NAME, "on", "off") is None
    for value, want in (("1", True), ("0", False), ("", None)):
        monkeypatch.setenv(NAME, value)
        assert env_switch(NAME, "on", "off") is want
    monkeypatch.setenv(NAME, "yes")
    with pytest.raises(ValueError, match=r"LMF_TEST_KNOB='yes': expected 1 \(run it\), 0 \(skip it\) or unset"):
        env_switch(NAME, "run it", "skip it")


def test_permutation(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_permutation(NAME, ("a", "b", "c")) is None
    monkeypatch.setenv(NAME, "")
    assert env_permutation(NAME, ("a", "b", "c")) is None
    monkeypatch.setenv(NAME, "c, a,b")
    assert env_permutation(NAME, ("a", "b", "c")) == ("c", "a", "b")
    for bad in ("a,b", "a,b,b", "a,b,c,d", "a,b,x"):
        monkeypatch.setenv(NAME, bad)
        with pytest.raises(ValueError, match=r"LMF_TEST_KNOB=.*: expected the letters a, b, c, each once, "
                                             r"comma-separated, or unset"):
            env_permutation(NAME, ("a", "b", "c"), "the letters")


@pytest.mark.parametrize("name, read", [
    ("LMF_CHECK_IDS", "latent_moe_fusion.ops.routed.expert_ids_check:device_id_check_enabled"),
    ("LMF_MXFP4_REGS", "latent_moe_fusion.ops.routed.producer_config:regs_enabled"),
])
def test_on_off_switches_refuse_other_words(monkeypatch, name, read):
    """Only 0 switched these off before, so a typo (`off`, `false`) silently left them on."""
    import importlib

    module, attr = read.split(":")
    enabled = getattr(importlib.import_module(module), attr)
    for value, want in (("1", True), ("0", False), ("", True)):
        monkeypatch.setenv(name, value)
        assert enabled() is want
    monkeypatch.delenv(name)
    assert enabled() is True
    monkeypatch.setenv(name, "off")
    with pytest.raises(ValueError, match=rf"{name}='off': expected 1 \(.*\), 0 \(.*\) or unset"):
        enabled()
