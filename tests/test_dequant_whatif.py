"""bench/dequant_whatif.py swaps lut_dequant._PAIRS_TEXT before the first compile: the name must stay the one
codes_to_bf16 reads, or the what-if would silently time the library's own dequantiser."""

import inspect

import pytest

from bench.dequant_whatif import VARIANTS, variant_text
from latent_moe_fusion.ops.routed.gluon import lut_dequant


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


def test_rows_of_each_target_keep_the_times_and_name_the_variant(tmp_path):
    import json

    from bench.dequant_whatif import COLUMNS, _rows

    decode = {"rows": [{"M": 8, "l1_us": 70.0, "l1_x_floor": 1.5, "l2_us": 40.0, "l2_x_floor": 1.8, "routed_us": 120.0,
                        "ring": "tma"}]}
    (tmp_path / "d.json").write_text(json.dumps(decode))
    (row,) = _rows("decode", "noscale", 3, tmp_path / "d.json")
    assert sorted(row) == sorted(COLUMNS["decode"]) and (row["variant"], row["round"], row["l1_us"]) == ("noscale", 3, 70.0)
    prefill = {"rows": [{"routing": "ep_share", "M": 4096, "variant": "staged 128", "op_us": 1841.0, "l1_us": 1094.0,
                         "l2_us": 563.0, "floor_us": 1.0}]}
    (tmp_path / "p.json").write_text(json.dumps(prefill))
    (row,) = _rows("prefill", "head", 0, tmp_path / "p.json")
    assert sorted(row) == sorted(COLUMNS["prefill"]) and (row["blocks"], row["l2_us"]) == ("staged 128", 563.0)
