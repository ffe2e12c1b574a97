"""bench/dequant_whatif.py swaps lut_dequant._PAIRS_TEXT before the first compile: the name must stay the one
codes_to_bf16 reads, or the what-if would silently time the library's own dequantiser."""

import inspect

import pytest

from bench.dequant_whatif import VARIANTS, variant_text
from latent_moe_fusion.ops.gluon_kernels import lut_dequant


def test_the_swapped_name_is_what_the_dequantiser_reads():
    assert lut_dequant._PAIRS_TEXT.value == lut_dequant.FP4_PAIRS_BF16_ASM
    assert "asm=_PAIRS_TEXT" in inspect.getsource(lut_dequant.codes_to_bf16.fn)


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_writes_all_eight_outputs_from_the_word(name):
    text = variant_text(name)
    assert (text == lut_dequant.FP4_PAIRS_BF16_ASM) == (name == "head")
    assert all(f"${i}" in text for i in range(9))
    assert ("mul.rn.bf16x2" in text) == (name in ("head", "half"))


def test_an_unknown_variant_names_the_known_ones():
    with pytest.raises(SystemExit, match="expected one of head, nodequant"):
        variant_text("fast")
