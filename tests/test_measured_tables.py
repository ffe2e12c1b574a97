"""The measured size thresholds shipped as package data: every table loads, every entry says where it came from, the
module constants read it, a malformed table is refused with its file and key named, and `plan --thresholds` prints it.
"""

import copy
import datetime
import json
from pathlib import Path

import pytest

from latent_moe_fusion.__main__ import main
from latent_moe_fusion.ops.common import symm_exchange
from latent_moe_fusion.ops.common.measured_tables import MeasuredTableError, load_table
from latent_moe_fusion.ops.common.tail_gemm import tail_gemm_configs
from latent_moe_fusion.ops.routed import gluon, producer_config, routed_gemv, routed_thresholds, schedule_rules
from latent_moe_fusion.ops.routed.router_fused import route_and_produce, route_and_project
from latent_moe_fusion.ops.routed.triton import moe_align

REPO = Path(__file__).resolve().parent.parent
TABLES = {
    "routed": routed_thresholds.ROUTED_THRESHOLDS,
    "tail": tail_gemm_configs.TAIL_THRESHOLDS,
    "exchange": symm_exchange.EXCHANGE_THRESHOLDS,
}
# The routed table's readers: each entry is the constant of the same name in upper case in one of these modules.
ROUTED_READERS = (producer_config, schedule_rules, routed_gemv, gluon, moe_align, route_and_project, route_and_produce)

# The values the code used before they moved into the tables: the tables must reproduce them (a re-measurement that
# changes one updates it here too, in the same commit).
BEFORE = {
    "decode_pairs": 4096, "routed_gemv_max_pairs": 64, "split_k_max_pairs": 16, "few_tokens_split_max_pairs": 32,
    "l2_tma_max_pairs": 2048, "prefill_regs_few_rows": 128, "prefill_staged_min_rows": 512,
    "prefill_regs_max_rows": 4096, "prefill_choice_max_rows": 4096, "spread_min_pairs": 8192,
    "group_after_fork_max_tokens": 1, "shared_side_max_tokens": 4, "shared_cublas_side_max_tokens": 16,
    "grid_shared_max_tokens": 256, "overlap_max_tokens": 64, "shared_first_min_tokens": 5,
    "shared_first_max_tokens": 128, "router_first_max_tokens": 32, "urgent_max_tokens": 8,
    "gemv_max_m": 2, "copies_fragments_min_tokens": 8, "copies_gather_min_tokens": 8,
}


def all_entries():
    return [entry for table in TABLES.values() for entry in table.entries.values()]


def test_every_threshold_table_in_the_package_is_loaded():
    shipped = {p.resolve() for p in (REPO / "latent_moe_fusion").rglob("*_thresholds.json")}
    assert shipped == {table.path for table in TABLES.values()}


@pytest.mark.parametrize("entry", all_entries(), ids=lambda e: e.name)
def test_every_entry_is_a_positive_int_with_complete_meta(entry):
    assert isinstance(entry.value, int) and entry.value > 0
    assert entry.unit.strip() and entry.decides.strip()
    assert entry.meta.device.strip() and entry.meta.rule.strip()
    datetime.date.fromisoformat(entry.meta.date)
    assert (REPO / entry.meta.source).is_file(), f"{entry.name}: source {entry.meta.source} is not in the repository"


def test_the_values_are_those_the_code_used_before():
    assert {e.name: e.value for e in all_entries()} == BEFORE


@pytest.mark.parametrize("name", routed_thresholds.NAMES)
def test_each_routed_constant_reads_its_entry(name):
    """One module defines the constant from the table; it, and every module importing it, holds the entry's value."""
    definition = f'{name.upper()} = ROUTED_THRESHOLDS.value("{name}")'
    defining = [m for m in ROUTED_READERS if definition in Path(m.__file__).read_text()]
    assert len(defining) == 1, f"{definition!r} in {[m.__name__ for m in defining]}"
    for module in ROUTED_READERS:
        if hasattr(module, name.upper()):
            assert getattr(module, name.upper()) == routed_thresholds.ROUTED_THRESHOLDS.value(name), module.__name__


def test_the_other_constants_read_their_entries():
    assert tail_gemm_configs.GEMV_MAX_M == tail_gemm_configs.TAIL_THRESHOLDS.value("gemv_max_m")
    exchange = symm_exchange.EXCHANGE_THRESHOLDS
    assert symm_exchange.WINDOWS["copies"] == ((exchange.value("copies_fragments_min_tokens"), None),
                                               (exchange.value("copies_gather_min_tokens"), None))
    # derived, not a table entry: the in-line shared GEMMs go first where the grids' shared tiles stop
    assert schedule_rules.SHARED_IN_LINE_FIRST_MIN_TOKENS == schedule_rules.GRID_SHARED_MAX_TOKENS + 1


def test_a_table_is_read_only():
    table = TABLES["routed"]
    with pytest.raises(TypeError):
        table.entries["decode_pairs"] = table.entries["split_k_max_pairs"]
    with pytest.raises(AttributeError):
        table.entries["decode_pairs"].value = 1


def test_an_unknown_name_is_named_with_the_ones_there_are():
    with pytest.raises(KeyError, match="no threshold 'decode_pair'.*decode_pairs"):
        TABLES["routed"].value("decode_pair")


# -- malformed tables, through the loader's path argument ------------------------------------------------------------

GOOD = {"thresholds": {
    "few": {"value": 4, "unit": "tokens", "decides": "a few tokens up to here",
            "meta": {"device": "NVIDIA H200", "date": "2026-11-30", "rule": "faster there", "source": "docs/x.md"}},
    "many": {"value": 64, "unit": "pairs", "decides": "many pairs beyond here",
             "meta": {"device": "NVIDIA H200", "date": "2026-11-29", "rule": "slower there", "source": "docs/y.md"}},
}}
NAMES = ("few", "many")


def _table(tmp_path: Path, data) -> Path:
    path = tmp_path / "toy_thresholds.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _broken(change) -> dict:
    data = copy.deepcopy(GOOD)
    change(data["thresholds"])
    return data


def test_a_good_table_loads(tmp_path):
    table = load_table(_table(tmp_path, GOOD), NAMES)
    assert [(e.name, e.value, e.unit) for e in table.entries.values()] == [("few", 4, "tokens"), ("many", 64, "pairs")]
    assert table.entry("many").meta.rule == "slower there"
    assert table.lines()[0] == "few = 4 tokens: a few tokens up to here"


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t.pop("many"), "missing threshold(s) many"),
    (lambda t: t.update(extra=t["few"]), "threshold(s) extra are read by no code"),
    (lambda t: t["few"].pop("value"), "threshold 'few': missing value"),
    (lambda t: t["few"].update(value="4"), "threshold 'few': value must be an integer > 0, got '4'"),
    (lambda t: t["few"].update(value=4.0), "threshold 'few': value must be an integer > 0, got 4.0"),
    (lambda t: t["few"].update(value=True), "threshold 'few': value must be an integer > 0, got True"),
    (lambda t: t["many"].update(value=0), "threshold 'many': value must be an integer > 0, got 0"),
    (lambda t: t["few"].update(unit=""), "threshold 'few': unit must be a non-empty string"),
    (lambda t: t["many"].pop("meta"), "threshold 'many': missing meta"),
    (lambda t: t["many"]["meta"].pop("source"), "threshold 'many': meta lacks source"),
    (lambda t: t["few"]["meta"].update(rule=" "), "threshold 'few': meta.rule must be a non-empty string"),
    (lambda t: t["few"]["meta"].update(date="30.11.2026"), "threshold 'few': meta.date must be an ISO date"),
    (lambda t: t.update(few=4), "threshold 'few': expected an object"),
], ids=["missing_entry", "unknown_entry", "no_value", "text_value", "float_value", "bool_value", "zero_value",
        "empty_unit", "no_meta", "meta_without_source", "blank_rule", "not_iso_date", "bare_number"])
def test_a_malformed_table_names_its_file_and_key(tmp_path, change, message):
    path = _table(tmp_path, _broken(change))
    with pytest.raises(MeasuredTableError) as exc:
        load_table(path, NAMES)
    assert str(exc.value).startswith(str(path)) and message in str(exc.value), str(exc.value)


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "not a readable JSON table"),
    ("[]", "expected an object with a 'thresholds' object"),
    ('{"about": "no entries"}', "expected an object with a 'thresholds' object"),
])
def test_an_unreadable_table_names_its_file(tmp_path, text, message):
    path = _table(tmp_path, text)
    with pytest.raises(MeasuredTableError, match=message) as exc:
        load_table(path, NAMES)
    assert str(path) in str(exc.value)


def test_a_missing_table_says_it_is_package_data(tmp_path):
    with pytest.raises(MeasuredTableError, match="measured table missing; it is package data") as exc:
        load_table(tmp_path / "absent_thresholds.json", NAMES)
    assert "absent_thresholds.json" in str(exc.value)


# -- plan --thresholds ------------------------------------------------------------------------------------------------

def test_plan_prints_the_routed_thresholds_on_request(capsys):
    assert main(["plan", "--m", "32", "--thresholds"]) == 0
    out = capsys.readouterr().out
    table = routed_thresholds.ROUTED_THRESHOLDS
    assert "thresholds (routed_thresholds.json, package data)" in out
    for entry in table.entries.values():
        assert f"{entry.name} = {entry.value} {entry.unit}: {entry.decides}" in out
        assert f"{entry.meta.device}, {entry.meta.date}, {entry.meta.source}: {entry.meta.rule}" in out


def test_plan_prints_no_thresholds_unasked(capsys):
    assert main(["plan", "--m", "32"]) == 0
    out = capsys.readouterr().out
    assert "routed_thresholds.json" not in out and "decode_pairs =" not in out
