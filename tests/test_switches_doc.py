"""docs/switches.md is the registry's own text (latent_moe_fusion/envs.py and tuning.py), so it names every
environment variable the package reads and every tuning override, and nothing else."""

from pathlib import Path

from latent_moe_fusion import envs

DOC = Path(__file__).resolve().parent.parent / "docs" / "switches.md"


def test_switches_doc_is_generated_from_the_registry():
    assert DOC.read_text() == envs.markdown(), (
        "docs/switches.md is out of date: python -m latent_moe_fusion switches --markdown > docs/switches.md")
