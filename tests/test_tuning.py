"""latent_moe_fusion/tuning.py: the tuning overrides are typed, checked on entry (naming the field and what it
takes), nest, and are what the ops read when they run, inside torch.compile'd code too."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

from latent_moe_fusion import tuning


def test_none_everywhere_outside_a_block_and_restored_after_one():
    assert tuning.current() == tuning.TuningOverrides() and tuning.current().active() == {}
    with tuning.overrides(group_first=True, regs_split="2,4") as inner:
        assert tuning.current() is inner and inner.active() == {"regs_split": (2, 4), "group_first": True}
        with tuning.overrides(group_first=None, tail_prefetch=3):  # an inner block changes only what it names
            assert tuning.current().active() == {"tail_prefetch": 3, "regs_split": (2, 4)}
        assert tuning.current() is inner
    with pytest.raises(RuntimeError), tuning.overrides(group_first=False):
        raise RuntimeError("the block's exception")
    assert tuning.current().active() == {}


def test_an_unknown_field_is_refused():
    with pytest.raises(TypeError, match="unknown tuning override.* prefil_regs: expected some of .*prefill_regs"):
        tuning.overrides(prefil_regs=0).__enter__()


def test_every_field_is_documented():
    for name, knob in tuning.knobs().items():
        assert knob.values and knob.default and knob.effect and knob.read_in.endswith(".py"), name


BAD = [
    ("pdl_sites", "tail,combine", r"pdl_sites='tail,combine': unknown site\(s\) combine; expected a comma list of "
                                  r"tail, routed, or all / none"),
    ("tail_prefetch", -1, "tail_prefetch=-1: expected a count of K steps >= 0"),
    ("tail_gemv", "4x512", r"tail_gemv='4x512': expected 'off' or ROWSxKxPRELOAD\[wWARPS\]\[sSTAGES\]"),
    ("tail_gemv", "4x512x3", "tail_gemv='4x512x3': rows, K step .* must be powers of two"),
    ("cute_tail_choice", "/no/such/table.json", "cute_tail_choice='/no/such/table.json': no such file"),
    ("down_projection_kernel", "cublas", "down_projection_kernel='cublas': expected a swap kernel label"),
    ("down_projection_kernel", "swap:16x24x128/w4/st6/s1", "block_n = 24 is not a power of two"),
    ("router_overlap_streams", "yes", r"router_overlap_streams='yes': expected True / 1 \(side by side\), "
                                      r"False / 0 \(one stream\) or None"),
    ("router_overlap_order", "gate", "router_overlap_order='gate': expected one of router, down"),
    ("shared_first_schedule", "on", r"shared_first_schedule='on': expected True / 1 \(shared expert first\)"),
    ("shared_first_order", "router,down", r"shared_first_order='router,down': expected the three branches \(in "
                                          r"launch order\) shared, router, down, each once"),
    ("shared_first_urgent", "1", "shared_first_urgent='1': expected one of none, route, all"),
    ("group_first", "yes", "group_first='yes': expected True / 1"),
    ("regs_shared", "overlap", "regs_shared='overlap': expected one of side, cublas, cublas_side"),
    ("grid_shared", "side", "grid_shared='side': expected one of grid, cublas"),
    ("shared_in_line", "early", "shared_in_line='early': expected one of first, after_l1"),
    ("prefill_regs", 256, "prefill_regs=256: expected 0 .*, a block of 16 or 32 or 64 or 128 rows"),
    ("regs_split", "2", "regs_split='2': expected two slice counts, e.g. 2,4"),
    ("regs_split", (0, 2), r"regs_split=\(0, 2\): slice counts must be >= 1"),
    ("producer_decode_shared_tiles", "12x128", "producer_decode_shared_tiles='12x128': rows and K must be powers of two"),
    ("producer_shared_split", 3, "producer_shared_split=3: expected a power of two >= 1"),
    ("producer_shared_l2_rows", 8, "producer_shared_l2_rows=8: expected a power of two >= 16"),
    ("producer_shared_l2_k", "x", "producer_shared_l2_k='x': expected a power of two >= 16"),
    ("routed_gemv", "nonsense", r"routed_gemv='nonsense': expected 0, 1 or L1ROWSxL2ROWSxWORDS"),
    ("routed_gemv", "4x4x2", "routed_gemv='4x4x2': RoutedGemvConfig.words must be >= 4"),
    ("mxfp4_regs", 2, r"mxfp4_regs=2: expected True / 1 \(these kernels"),
    ("mxfp4_ring", "tmx", "mxfp4_ring='tmx': expected one of loads, cp2, cp4, tma, or two of them as L1,L2"),
    ("mxfp4_load_order", "soon", "mxfp4_load_order='soon': expected one of auto, early, late"),
    ("mxfp4_maxnreg", "300", "mxfp4_maxnreg='300': expected L1,L2 .* register count in 24 .. 255"),
    ("deepgemm_routed_layout", "maskd", "deepgemm_routed_layout='maskd': expected one of masked, contiguous"),
    ("staged_kernel", "fast", r"staged_kernel='fast': expected one of kappa, kappa_plain, staged, ws \(the kernels of the 128-row "
                              r"prefill blocks\)"),
    ("w4a8_rows", "96", r"w4a8_rows='96': expected one of 64, 128 \(weight rows per W4A8 program\)"),
]


def test_every_field_has_a_bad_value_here():
    assert {name for name, _, _ in BAD} == set(tuning.NAMES)


@pytest.mark.parametrize("name, value, message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_a_bad_value_is_refused_on_entry_naming_the_field(name, value, message):
    with pytest.raises(ValueError, match=message):
        tuning.overrides(**{name: value}).__enter__()
    with pytest.raises(ValueError, match=message):
        tuning.TuningOverrides(**{name: value})
    assert tuning.current().active() == {}


@pytest.mark.parametrize("name, given, normalised", [
    ("pdl_sites", " routed , TAIL ", ("tail", "routed")), ("pdl_sites", True, ("tail", "routed")),
    ("pdl_sites", "none", ()), ("pdl_sites", ["routed"], ("routed",)),
    ("tail_prefetch", "7", 7), ("tail_gemv", " off ", "off"),
    ("router_overlap_streams", "0", False), ("shared_first_schedule", 1, True),
    ("shared_first_order", "down, router,shared", ("down", "router", "shared")),
    ("prefill_regs", "32", 32), ("prefill_regs", "choice", "choice"), ("prefill_regs", 0, 0),
    ("regs_split", [2, 4], (2, 4)), ("producer_decode_shared_tiles", "16X128", (16, 128)),
    ("producer_shared_split", "8", 8), ("routed_gemv", "1", True), ("routed_gemv", "4x4x64w1p2", "4x4x64w1p2"),
    ("mxfp4_ring", "tma", ("tma", "tma")), ("mxfp4_ring", "loads,cp4", ("loads", "cp4")),
    ("mxfp4_maxnreg", "128,none", (128, "none")), ("mxfp4_maxnreg", 96, (96, 96)),
])
def test_text_and_typed_forms_are_normalised(name, given, normalised):
    with tuning.overrides(**{name: given}) as knobs:
        assert getattr(knobs, name) == normalised
        with tuning.overrides(group_first=True):  # normalised values survive being set again
            assert getattr(tuning.current(), name) == normalised


def test_the_overrides_belong_to_the_context_that_set_them():
    seen = {}
    with tuning.overrides(tail_prefetch=5):
        worker = threading.Thread(target=lambda: seen.setdefault("thread", tuning.current().tail_prefetch))
        worker.start()
        worker.join()
        seen["copied"] = contextvars.copy_context().run(lambda: tuning.current().tail_prefetch)
    assert seen == {"thread": None, "copied": 5}


@torch.library.custom_op("lmf_test::prefetch_plus", mutates_args=())
def _prefetch_plus(x: torch.Tensor) -> torch.Tensor:
    """Reads an override inside the op, as the library's ops do."""
    steps = tuning.current().tail_prefetch
    return x + (-1 if steps is None else steps)


@_prefetch_plus.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_compiled_code_reads_the_overrides_when_it_runs():
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: _prefetch_plus(x) * 2, fullgraph=True, backend="aot_eager")
    x = torch.zeros(2)
    assert compiled(x).tolist() == [-2.0, -2.0]
    with tuning.overrides(tail_prefetch=5):
        assert compiled(x).tolist() == [10.0, 10.0]  # same compiled graph, the value of this call
    assert compiled(x).tolist() == [-2.0, -2.0]
