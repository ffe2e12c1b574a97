"""Tile choices of pick_config on an sm_90 GPU, and the automatic fallback from TMA weight tiles,
checked on any machine (the GPU and interpreter probes are patched; nothing is launched)."""

from __future__ import annotations

import pytest
import torch

from latent_moe_fusion.ops.routed import expert_schedule, producer_config, routed_plan, schedule_rules
from latent_moe_fusion.ops.routed.triton.weight_tiles import DEQUANT_LUT

LOCAL_EXPERTS = 112


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setattr(producer_config, "_has_sm90", lambda: True)
    monkeypatch.setattr(producer_config, "interpreting", lambda: False)
    monkeypatch.setattr(expert_schedule, "interpreting", lambda: False)
    monkeypatch.setattr(routed_plan, "interpreting", lambda: False)


@pytest.mark.parametrize("m,split", [(1, (2, 2)), (2, (1, 1)), (32, (1, 1))])
def test_mxfp4_decode_defaults(sm90, m, split):
    cfg = producer_config.pick_config(m * 16, "mxfp4", torch.bfloat16, LOCAL_EXPERTS)
    assert (cfg.l1.split_k, cfg.l2.split_k) == split  # split-K only for a single top-16 token
    assert cfg.dequant == DEQUANT_LUT and cfg.l1.tma and cfg.l2.tma and cfg.bm == 16
    assert (cfg.l1.bn, cfg.l1.bk, cfg.l1.num_stages, cfg.l1.maxnreg) == (64, 128, 4, 0)


def test_prefill_and_bf16_keep_pointer_loads_and_no_split(sm90):
    for fmt, pairs in (("mxfp4", 4096 * 16), ("bf16", 16), ("bf16", 4096 * 16)):
        cfg = producer_config.pick_config(pairs, fmt, torch.bfloat16, LOCAL_EXPERTS)
        assert not (cfg.l1.tma or cfg.l2.tma), (fmt, pairs)
        assert cfg.l1.split_k == cfg.l2.split_k == 1, (fmt, pairs)


def _mxfp4_weights(contiguous: bool) -> tuple[torch.Tensor, torch.Tensor]:
    experts, inter, latent = 2, 64, 128
    w13 = torch.zeros(experts, 2 * inter, latent // 2, dtype=torch.uint8)
    w2 = torch.zeros(experts, latent, inter // 2, dtype=torch.uint8)
    if not contiguous:  # a column-block view of a wider buffer: rows are not packed
        w13 = torch.zeros(experts, 2 * inter, latent, dtype=torch.uint8)[:, :, : latent // 2]
    return w13, w2


@pytest.mark.parametrize("contiguous", [True, False])
def test_automatic_config_drops_tma_where_a_descriptor_cannot_be_built(sm90, contiguous):
    w13, w2 = _mxfp4_weights(contiguous)
    z = torch.zeros(1, 128, dtype=torch.bfloat16)
    cfg = schedule_rules.resolve_config(z, 16, 2, "mxfp4", 64, None, None, w13, w2)
    assert cfg.l1.tma == contiguous
    assert cfg.l2.tma  # w2 is contiguous either way


def test_explicit_tma_config_on_an_unfit_weight_is_kept_and_refused_at_launch(sm90):
    w13, w2 = _mxfp4_weights(False)
    z = torch.zeros(1, 128, dtype=torch.bfloat16)
    chosen = producer_config.pick_config(16, "mxfp4", torch.bfloat16, 2)
    cfg = schedule_rules.resolve_config(z, 16, 2, "mxfp4", 64, None, chosen, w13, w2)
    assert cfg.l1.tma  # the caller asked for it: _weight_descriptor raises with what to do
    with pytest.raises(ValueError, match="tma=False"):
        expert_schedule._weight_descriptor(w13, cfg.l1.bn, cfg.l1.bk, True)


@pytest.fixture
def hopper(sm90, monkeypatch):
    monkeypatch.setattr(producer_config, "_is_hopper", lambda: True)


def test_routed_regs_for_mxfp4_on_hopper_while_experts_hold_few_rows(hopper, monkeypatch, tuned):
    def pick(pairs, fmt="mxfp4", experts=LOCAL_EXPERTS):
        cfg = producer_config.pick_config(pairs, fmt, torch.bfloat16, experts)
        return cfg.routed_regs, cfg.bm

    def choice_bm(pairs, fmt="mxfp4"):
        return producer_config.pick_config(pairs, fmt, torch.bfloat16, LOCAL_EXPERTS).device_choice_bm

    assert pick(16) == (True, 16)  # decode: 16-row blocks (a single token: its K-sliced bf16 kernels) ...
    assert pick(32 * 16) == (True, producer_config.FP8_BLOCK_M)  # ... 8 rows on the FP8 L1 (LMF_ROUTED_FP8 default)
    monkeypatch.setenv(producer_config.ROUTED_FP8_ENV, "0")
    assert pick(32 * 16) == (True, 16)
    monkeypatch.delenv(producer_config.ROUTED_FP8_ENV)
    assert pick(2048) == (True, 32)
    assert pick(64 * 16, experts=16) == (True, 32)  # where decode would take 64-row Triton blocks: 32-row regs blocks
    few = producer_config.PREFILL_REGS_FEW_ROWS * LOCAL_EXPERTS  # pairs, were every one local: M = 896 at top-16
    assert pick(512 * 16) == pick(few) == (True, 32)  # up to here 32-row blocks, beyond 64-row ones
    assert pick(few + 16) == pick(1024 * 16) == (True, 64) and pick(160 * 16, experts=16) == (True, 64)
    staged = producer_config.PREFILL_STAGED_MIN_ROWS * LOCAL_EXPERTS  # pairs, were every one local: M = 3584
    assert pick(staged) == (True, 64) and pick(staged + 16) == pick(4096 * 16) == (True, 128)  # the staged blocks
    assert pick(32768 * 16) == pick(10**6 * 16) == (True, 128) and choice_bm(32768 * 16) == 0  # at any size
    tuned(prefill_regs=producer_config.PREFILL_CHOICE_SETTING)  # the policy before
    assert pick(few + 16) == pick(4096 * 16) == (True, 64)
    most = producer_config.PREFILL_REGS_MAX_ROWS * LOCAL_EXPERTS  # pairs, were every one local: M = 28672 at top-16
    assert pick(most) == (True, producer_config.PREFILL_REGS_BLOCK_M) == (True, 64)
    assert pick(most + 16) == (False, 128) and pick(32768 * 16) == (False, 128)  # beyond: the Triton tiles ...
    choice = producer_config.PREFILL_REGS_BLOCK_M  # ... or the 64-row blocks, picked on the GPU by the local rows
    assert choice_bm(most + 16) == choice_bm(32768 * 16) == choice and choice_bm(most) == choice_bm(2048) == 0
    assert choice_bm(most + 16, fmt="bf16") == 0
    assert pick(16, fmt="bf16")[0] is False
    tuned(prefill_regs=0)  # the Triton tiles beyond the decode blocks
    assert pick(64 * 16, experts=16) == (False, 64) and pick(512 * 16) == (False, 128)
    assert choice_bm(32768 * 16) == 0  # forced: no choice on the GPU
    assert pick(16) == (True, 16)  # decode blocks are not its business
    for rows in ("16", "32", "64", "128"):  # regs blocks of these rows at any size
        tuned(prefill_regs=rows)
        assert pick(32768 * 16) == (True, int(rows)) and pick(64 * 16, experts=16) == (True, int(rows))
    with pytest.raises(ValueError, match="prefill_regs='256': expected 0 .*, a block of 16 or 32 or 64 or 128 rows"
                                         ".*'choice'"):
        tuned(prefill_regs="256")
    tuned(prefill_regs=None, mxfp4_regs=False)
    assert pick(16)[0] is False and pick(512 * 16) == (False, 128) and choice_bm(32768 * 16) == 0


def test_a_given_regs_config_that_cannot_run_says_why():
    """On this CPU machine (interpreter) the Gluon kernels cannot run: a config asking for them raises
    with the reason; the picked config never asks."""
    from dataclasses import replace

    from tests.expert_problems import make_problem

    p = make_problem(2, latent=128, inter=128, num_experts=4, top_k=2, hidden=128, inter_s=64, weight_format="mxfp4")
    cfg = replace(producer_config.pick_config(4, "mxfp4", torch.bfloat16, 4), routed_regs=True)
    with pytest.raises(ValueError, match="routed_regs.*(sm_90|TRITON_INTERPRET)"):
        expert_schedule.run_experts(*p.routed_args(), config=cfg)
    cfg = replace(producer_config.pick_config(4, "mxfp4", torch.bfloat16, 4), device_choice_bm=32)
    with pytest.raises(ValueError, match="device_choice_bm.*(sm_90|TRITON_INTERPRET).*device_choice_bm=0"):
        expert_schedule.run_experts(*p.routed_args(), config=cfg)


def test_regs_k_slices_for_a_single_token_by_default_and_anywhere_by_override(hopper, tuned):

    def split(pairs):
        return producer_config.pick_config(pairs, "mxfp4", torch.bfloat16, LOCAL_EXPERTS).regs_split

    assert split(16) == producer_config.REGS_DECODE_SPLIT
    assert split(2 * 16) == (1, 1) and split(128 * 16) == (1, 1)
    tuned(regs_split="3,2")
    assert split(16) == (3, 2) and split(8 * 16) == (3, 2) and split(128 * 16) == (3, 2)


@pytest.mark.parametrize("forced,match", [("4", "two slice counts"), ("a,b", "two slice counts"),
                                          ("0,2", ">= 1")])
def test_regs_split_override_rejects_bad_values(hopper, tuned, forced, match):
    with pytest.raises(ValueError, match=f"regs_split.*{match}"):
        tuned(regs_split=forced)


def test_regs_split_must_be_two_positive_counts():
    base = producer_config.pick_config(16, "mxfp4", torch.bfloat16, LOCAL_EXPERTS)
    with pytest.raises(ValueError, match="regs_split must be two slice counts"):
        producer_config.ProducerConfig(base.bm, base.l1, base.l2, regs_split=(0, 2))
    with pytest.raises(ValueError, match="regs_split must be two slice counts"):
        producer_config.ProducerConfig(base.bm, base.l1, base.l2, regs_split=(2,))


def test_resolved_configs_are_memoised_and_follow_the_environment(sm90, monkeypatch, tuned):
    """resolve_config caches its answer (host time per call); a change of any variable or override pick_config
    reads, or of the weights' layout, must still change it."""
    w13, w2 = _mxfp4_weights(True)
    z = torch.zeros(1, 128, dtype=torch.bfloat16)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    first = schedule_rules.resolve_config(z, 16, 2, "mxfp4", 64, None, None, w13, w2)
    assert schedule_rules.resolve_config(z, 16, 2, "mxfp4", 64, None, None, w13, w2) is first
    tuned(producer_decode_shared_tiles="16x128")
    narrow = schedule_rules.resolve_config(z, 16, 2, "mxfp4", 64, None, None, w13, w2)
    assert narrow.l1.bn_shared == 16 and first.l1.bn_shared != 16
    unfit, _ = _mxfp4_weights(False)
    assert not schedule_rules.resolve_config(z, 16, 2, "mxfp4", 64, None, None, unfit, w2).l1.tma


def test_config_context_covers_every_variable_pick_config_reads():
    """The memo key (config_context) must list each environment variable and tuning override producer_config
    reads (and those of the functions it calls in other modules: regs_switched_off, routed_gemv_setting)."""
    import inspect
    import re

    source = inspect.getsource(producer_config)
    read = set(re.findall(r'envs\.(?:read|is_set)\(([A-Z][A-Z0-9_]*|"[A-Z][A-Z0-9_]*")', source))
    names = {r.strip('"') if r.startswith('"') else getattr(producer_config, r) for r in read}
    assert names <= set(producer_config.CONFIG_ENVS), names - set(producer_config.CONFIG_ENVS)
    knobs = set(re.findall(r"(?:tuning\.current\(\)|knobs)\.([a-z_0-9]+)", source))
    assert knobs <= set(producer_config.CONFIG_OVERRIDES), knobs - set(producer_config.CONFIG_OVERRIDES)
    assert {"mxfp4_regs", "routed_gemv"} <= set(producer_config.CONFIG_OVERRIDES)


def test_single_token_shared_programs_beside_the_regs_kernels(hopper, tuned):

    def tiles(pairs):
        cfg = producer_config.pick_config(pairs, "mxfp4", torch.bfloat16, LOCAL_EXPERTS)
        return cfg.l1.split_k, (cfg.l1.shared_bn, cfg.l1.bk_shared), cfg.l2.shared_bn, cfg.l2.bk_shared

    single = (producer_config.REGS_SINGLE_TOKEN_SHARED_SPLIT, producer_config.REGS_SINGLE_TOKEN_SHARED_TILES, 64,
              producer_config.REGS_SINGLE_TOKEN_SHARED_L2_K)
    assert tiles(16) == single
    assert tiles(2 * 16) == (producer_config.FEW_TOKENS_SHARED_SPLIT,) + single[1:]  # two tokens: more K slices
    assert tiles(4 * 16) == single  # up to 4 tokens (the routed GEMV's): a token's shapes
    assert tiles(8 * 16) == (1, producer_config.DECODE_SHARED_TILES, 64, 32)  # more tokens: as before
    tuned(routed_gemv=False)
    assert tiles(4 * 16) == (1, producer_config.DECODE_SHARED_TILES, 64, 32)  # the MMA kernels' few tokens
    tuned(routed_gemv=None, producer_shared_split="2", producer_shared_l2_rows=32, producer_shared_l2_k="128")
    assert tiles(16)[0] == 2 and tiles(16)[2:] == (32, 128) and tiles(4 * 16)[0] == 2 and tiles(8 * 16)[0] == 1


@pytest.mark.parametrize("knob", ["producer_shared_split", "producer_shared_l2_rows", "producer_shared_l2_k"])
@pytest.mark.parametrize("forced", ["3", "x", "0"])
def test_shared_program_overrides_reject_bad_values(hopper, tuned, knob, forced):
    with pytest.raises(ValueError, match=f"{knob}='{forced}': expected a power of two"):
        tuned(**{knob: forced})


def _launch_order_beside_the_regs_kernels(monkeypatch, tokens: int) -> dict:
    """run_experts with every launch recorded (name -> arguments, in launch order), routed tiles on the
    register-dequant kernels and the shared expert's Triton grids on the side stream."""
    from dataclasses import replace

    launched = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.setdefault(self.name, args)

    monkeypatch.setattr(expert_schedule, "l1_kernel", Recorder("l1"))
    monkeypatch.setattr(expert_schedule, "l2_kernel", Recorder("l2"))
    monkeypatch.setattr(expert_schedule, "launch_l1_finish", lambda *a, **k: launched.setdefault("finish", a))
    monkeypatch.setattr(routed_plan, "regs_reason", lambda *a: None)
    monkeypatch.setattr(routed_plan, "split_reason", lambda *a: None)
    monkeypatch.setattr(expert_schedule, "launch_routed_l1", lambda *a, **k: launched.setdefault("routed_l1", a))
    monkeypatch.setattr(expert_schedule, "launch_routed_l2", lambda *a, **k: launched.setdefault("routed_l2", a))
    monkeypatch.setattr(expert_schedule, "launch_combine", lambda *a, **k: None)
    monkeypatch.setattr(expert_schedule, "_side_stream", lambda dev: None)
    monkeypatch.setattr(routed_plan, "shared_strategy", lambda m_s: "side")
    real_grouping = expert_schedule.group_by_expert

    def grouping(*args):
        launched.setdefault("grouping", args)
        return real_grouping(*args)

    monkeypatch.setattr(expert_schedule, "group_by_expert", grouping)
    hidden, inter_s, latent, inter, experts = 64, 32, 64, 64, 4
    z = torch.randn(tokens, latent, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 2], [1, 3]][:tokens], dtype=torch.int32)
    w13 = torch.zeros(experts, 2 * inter, latent // 2, dtype=torch.uint8)
    w2 = torch.zeros(experts, latent, inter // 2, dtype=torch.uint8)
    s13 = torch.zeros(experts, 2 * inter, latent // 32, dtype=torch.uint8)
    s2 = torch.zeros(experts, latent, inter // 32, dtype=torch.uint8)
    x_s = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    shared = expert_schedule.SharedExpert(x_s, torch.randn(inter_s, hidden, dtype=torch.bfloat16),
                                          torch.randn(inter_s, hidden, dtype=torch.bfloat16),
                                          torch.randn(hidden, inter_s, dtype=torch.bfloat16),
                                          torch.empty(tokens, hidden, dtype=torch.bfloat16))
    base = producer_config.pick_config(2, "mxfp4", torch.bfloat16, experts)
    cfg = replace(base, bm=16, routed_regs=True, regs_split=(1, 1))
    expert_schedule.run_experts(z, ids, torch.rand(tokens, 2), w13, w2, s13, s2, "mxfp4", 4.0, 25.0,
                                shared=shared, config=cfg)
    return launched


def test_shared_grids_beside_the_regs_kernels_get_int32_index_tensors(monkeypatch):
    """Beside the register-dequant kernels a single token's grouping runs after the shared expert's
    launches; the Triton grids then get placeholder index tensors, which must still be int32 (they are
    compiled with them)."""
    launched = _launch_order_beside_the_regs_kernels(monkeypatch, 1)
    assert list(launched) == ["l1", "l2", "grouping", "routed_l1", "routed_l2"], list(launched)
    for name in ("l1", "l2"):
        sorted_pairs, block_expert = launched[name][3], launched[name][4]
        assert sorted_pairs.dtype == torch.int32 and block_expert.dtype == torch.int32, name
    assert launched["routed_l1"][3].dtype == torch.int32  # the real grouping, launched after the side stream's work


@pytest.mark.parametrize(("tokens", "forced", "first"), [(2, None, True), (1, True, True), (2, False, False)])
def test_grouping_goes_first_from_two_tokens_on(monkeypatch, tuned, tokens, forced, first):
    tuned(group_first=forced)
    order = list(_launch_order_beside_the_regs_kernels(monkeypatch, tokens))
    assert (order.index("grouping") < order.index("l1")) == first, order


def test_grouping_order_override_rejects_other_values(tuned):
    with pytest.raises(ValueError, match="group_first='yes'"):
        tuned(group_first="yes")
