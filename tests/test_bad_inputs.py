"""Bad arguments raise LmfInputError naming the argument (in-process cases, then cases that need 2 gloo ranks)."""

import re

import pytest
import torch
import torch.distributed as dist

from latent_moe_fusion.ops import LmfInputError
from tests import multirank
from tests.op_inputs import TINY, producer_args, routed_args, tail_args

BF16 = torch.bfloat16
M = 4
E, L, INTER, H = TINY.num_experts, TINY.latent_size, TINY.moe_intermediate_size, TINY.hidden_size


def _routed(gen, weight_format="bf16"):
    return routed_args(M, BF16, weight_format, gen)


def _producer(gen, weight_format="bf16", mode="local"):
    return producer_args(M, BF16, weight_format, gen, mode=mode)


def _tail(gen, mode="local"):
    return tail_args(M, BF16, gen, mode=mode)


def _mxfp4_latent_48(gen):
    """Consistent mxfp4 shapes except that L = 48 is not a multiple of 32."""
    args = _routed(gen, "mxfp4")
    args["z"] = torch.randn(M, 48, generator=gen).to(BF16)
    args["w13"] = torch.zeros(E, 2 * INTER, 24, dtype=torch.uint8)
    args["w13_scale"] = torch.zeros(E, 2 * INTER, 1, dtype=torch.uint8)
    return args


def _mxfp4_inter_48(gen):
    args = _routed(gen, "mxfp4")
    args["w13"] = torch.zeros(E, 96, L // 2, dtype=torch.uint8)
    args["w13_scale"] = torch.zeros(E, 96, L // 32, dtype=torch.uint8)
    args["w2"] = torch.zeros(E, L, 24, dtype=torch.uint8)
    args["w2_scale"] = torch.zeros(E, L, 1, dtype=torch.uint8)
    return args


def _set(make, **changes):
    """A case builder: the valid arguments of `make`, with some replaced by functions of (args, gen)."""

    def build(gen):
        args = make(gen)
        for name, change in changes.items():
            args[name] = change(args, gen)
        return args

    return build


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# (op name, argument builder, regex the message must contain). Every case is a distinct mistake.
CASES = {
    # dtypes
    "z_fp16": ("routed_experts", _set(_routed, z=lambda a, g: a["z"].half()), r"\bz must have dtype bfloat16, float32; got float16"),
    "ids_int64": ("routed_experts", _set(_routed, topk_ids=lambda a, g: a["topk_ids"].long()), r"topk_ids must have dtype int32"),
    "weights_bf16": ("routed_experts", _set(_routed, topk_weights=lambda a, g: a["topk_weights"].to(BF16)), r"topk_weights must have dtype float32"),
    "w13_fp32_with_bf16_z": ("routed_experts", _set(_routed, w13=lambda a, g: a["w13"].float()), r"w13 must have dtype bfloat16"),
    "w2_uint8_for_bf16": ("routed_experts", _set(_routed, w2=lambda a, g: a["w2"].view(torch.uint8)), r"w2 must have dtype bfloat16"),
    "ws_fp32_with_bf16_y_n": ("latent_tail", _set(_tail, ws=lambda a, g: a["ws"].float()), r"\bws must have dtype bfloat16"),
    "x_s_fp32_with_bf16_z": ("moe_shared_producer", _set(_producer, x_s=lambda a, g: a["x_s"].float()), r"x_s must have dtype bfloat16"),
    "rms_weight_fp16": ("moe_shared_producer", _set(_producer, rms_weight=lambda a, g: a["rms_weight"].half()), r"rms_weight must have dtype"),
    "mxfp4_scale_fp32": ("routed_experts", _set(lambda g: _routed(g, "mxfp4"), w2_scale=lambda a, g: a["w2_scale"].float()), r"w2_scale must have dtype uint8"),
    # shapes
    "z_3d": ("routed_experts", _set(_routed, z=lambda a, g: a["z"].unsqueeze(0)), r"\bz must be 2-D"),
    "ids_rows": ("routed_experts", _set(_routed, topk_ids=lambda a, g: a["topk_ids"][:3].contiguous()), r"topk_ids has 3 rows but z has 4 tokens"),
    "weights_shape": ("routed_experts", _set(_routed, topk_weights=lambda a, g: a["topk_weights"][:, :2].contiguous()), r"topk_weights has shape \(4, 2\)"),
    "w13_latent": ("routed_experts", _set(_routed, w13=lambda a, g: a["w13"][:, :, :64].contiguous()), r"w13 has shape \(16, 128, 64\), expected \(16, 128, 128\) \(\[E, 2I, L\]"),
    "w13_odd_rows": ("routed_experts", _set(_routed, w13=lambda a, g: a["w13"][:, :127].contiguous()), r"w13 dim 1 \(127\) must be even"),
    "w2_shape": ("routed_experts", _set(_routed, w2=lambda a, g: a["w2"][:, :, :32].contiguous()), r"w2 has shape \(16, 128, 32\), expected \(16, 128, 64\) \(\[E, L, I\]\)"),
    "mxfp4_scale_shape": ("routed_experts", _set(lambda g: _routed(g, "mxfp4"), w13_scale=lambda a, g: a["w13_scale"][:, :, :2].contiguous()), r"w13_scale has shape"),
    "rms_weight_shape": ("moe_shared_producer", _set(_producer, rms_weight=lambda a, g: a["rms_weight"][:64].contiguous()), r"rms_weight has shape \(64,\)"),
    "w3_s_shape": ("moe_shared_producer", _set(_producer, w3_s=lambda a, g: a["w3_s"][:64].contiguous()), r"w3_s has shape \(64, 256\)"),
    "w2_s_shape": ("moe_shared_producer", _set(_producer, w2_s=lambda a, g: a["w2_s"].t().contiguous()), r"w2_s has shape \(128, 256\)"),
    "w_up_shape": ("latent_tail", _set(_tail, w_up=lambda a, g: a["w_up"][:, :64].contiguous()), r"w_up has shape \(256, 64\)"),
    "ws_tokens": ("latent_tail", _set(_tail, ws=lambda a, g: a["ws"][:, :3].contiguous()), r"ws has shape \(1, 3, 256\)"),
    "x_s_rows_token_publish": ("moe_shared_producer", _set(lambda g: _producer(g, mode="token_publish"), x_s=lambda a, g: torch.cat([a["x_s"]] * 2)),
                               r"x_s has 8 rows; mode='token_publish' with R = 1 needs 4 .*pass group_name"),
    # device ('meta' stands in for another device on a CPU-only machine)
    "w13_other_device": ("routed_experts", _set(_routed, w13=lambda a, g: a["w13"].to("meta")), r"w13 is on meta but the activations are on cpu"),
    "ids_other_device": ("routed_experts", _set(_routed, topk_ids=lambda a, g: a["topk_ids"].to("meta")), r"topk_ids is on meta"),
    "w_up_other_device": ("latent_tail", _set(_tail, w_up=lambda a, g: a["w_up"].to("meta")), r"w_up is on meta"),
    "w2_s_other_device": ("moe_shared_producer", _set(_producer, w2_s=lambda a, g: a["w2_s"].to("meta")), r"w2_s is on meta"),
    # strides
    "z_non_contiguous": ("routed_experts", _set(_routed, z=lambda a, g: _non_contiguous(a["z"])), r"\bz must be contiguous .*call \.contiguous\(\)"),
    "w2_non_contiguous": ("routed_experts", _set(_routed, w2=lambda a, g: _non_contiguous(a["w2"])), r"w2 must be contiguous"),
    "ws_non_contiguous": ("latent_tail", _set(_tail, ws=lambda a, g: _non_contiguous(a["ws"])), r"\bws must be contiguous"),
    # values
    "id_out_of_range": ("routed_experts", _set(_routed, topk_ids=lambda a, g: a["topk_ids"].index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(E, dtype=torch.int32))),
                        r"topk_ids holds expert id 16 but w13 has only 16 experts"),
    "beta_zero": ("routed_experts", _set(_routed, beta=lambda a, g: 0.0), r"\bbeta must be a finite number > 0"),
    "lin_beta_nan": ("routed_experts", _set(_routed, lin_beta=lambda a, g: float("nan")), r"lin_beta must be a finite number > 0"),
    "eps_zero": ("moe_shared_producer", _set(_producer, eps=lambda a, g: 0.0), r"\beps must be a finite number > 0"),
    "eps_negative": ("moe_shared_producer", _set(_producer, eps=lambda a, g: -1e-5), r"\beps must be a finite number > 0, got -1e-05"),
    # mxfp4
    "mxfp4_latent_not_32": ("routed_experts", _mxfp4_latent_48, r"z\.shape\[1\] = 48 .*not divisible by 32"),
    "mxfp4_inter_not_32": ("routed_experts", _mxfp4_inter_48, r"w13\.shape\[1\] / 2 = 48 .*not divisible by 32"),
    "mxfp4_missing_scale": ("routed_experts", _set(lambda g: _routed(g, "mxfp4"), w13_scale=lambda a, g: None), r"w13_scale is required for weight_format='mxfp4'"),
    "mxfp4_weights_bf16": ("routed_experts", _set(lambda g: _routed(g, "mxfp4"), w13=lambda a, g: torch.zeros(E, 2 * INTER, L, dtype=BF16)), r"w13 must have dtype uint8"),
    "bf16_with_scale": ("routed_experts", _set(_routed, w2_scale=lambda a, g: torch.zeros(E, L, INTER // 32, dtype=torch.uint8)), r"w2_scale must be None for weight_format='bf16'"),
    "weight_format_unknown": ("routed_experts", _set(_routed, weight_format=lambda a, g: "fp8"), r"weight_format must be one of \('bf16', 'mxfp4'\), got 'fp8'"),
    # modes and groups
    "mode_unknown_producer": ("moe_shared_producer", _set(_producer, mode=lambda a, g: "tp"), r"mode must be one of .* got 'tp'"),
    "mode_unknown_tail": ("latent_tail", _set(_tail, mode=lambda a, g: "sp"), r"mode must be one of .* got 'sp'"),
    "missing_group_hidden_scatter": ("latent_tail", _set(_tail, mode=lambda a, g: "hidden_scatter", ws=lambda a, g: torch.randn(2, M, H // 2, generator=g).to(BF16)),
                                     r"ws holds 2 fragments along dim 0 but no group \(R = 1\)"),
    "missing_group_token_publish": ("latent_tail", _set(_tail, mode=lambda a, g: "token_publish", ws=lambda a, g: torch.randn(M, 2, H, generator=g).to(BF16)),
                                    r"ws holds 2 fragments along dim 1 but no group \(R = 1\)"),
    "group_without_distributed": ("latent_tail", _set(_tail, mode=lambda a, g: "hidden_scatter", group_name=lambda a, g: "tp0"),
                                  r"group_name='tp0' was given but torch.distributed is not initialized"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(rng_seed, case):
    op_name, build, pattern = CASES[case]
    args = build(torch.Generator().manual_seed(rng_seed))
    with pytest.raises(LmfInputError, match=pattern) as info:
        getattr(torch.ops.lmf, op_name)(**args)
    assert str(info.value).startswith(f"lmf::{op_name}: ")


def test_fake_impl_validates_too(rng_seed):
    """On meta tensors (and under torch.compile) the fake impl raises the same errors."""
    args = routed_args(M, BF16, "bf16", torch.Generator().manual_seed(rng_seed))
    args = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    assert torch.ops.lmf.routed_experts(**args).device.type == "meta"
    args["topk_ids"] = args["topk_ids"].long()
    with pytest.raises(LmfInputError, match="topk_ids must have dtype int32"):
        torch.ops.lmf.routed_experts(**args)


def test_cases_are_many_and_distinct():
    assert len(CASES) >= 15
    assert len({pattern for _, _, pattern in CASES.values()}) == len(CASES)


# -- cases that need a live 2-rank group -----------------------------------------------------------------------------


def group_errors_on_ranks(rank: int, world: int, seed: int) -> dict:
    group_name = dist.group.WORLD.group_name
    gen = torch.Generator().manual_seed(seed)
    producer_tp = producer_args(M, BF16, "bf16", gen, mode="hidden_scatter", group_name=group_name, world=world)
    producer_sp = producer_args(M, BF16, "bf16", gen, mode="token_publish", group_name=group_name, world=world)
    tail_tp = tail_args(M, BF16, gen, mode="hidden_scatter", group_name=group_name, world=world)
    tail_sp = tail_args(M, BF16, gen, mode="token_publish", group_name=group_name, world=world)
    cases = {
        "producer_local_on_2_ranks": ("moe_shared_producer", {**producer_tp, "mode": "local"}),
        "tail_local_on_2_ranks": ("latent_tail", {**tail_tp, "mode": "local", "ws": tail_tp["ws"][:1].contiguous()}),
        "tail_ws_4_fragments_tp": ("latent_tail", {**tail_tp, "ws": torch.cat([tail_tp["ws"]] * 2)}),
        "tail_ws_1_fragment_sp": ("latent_tail", {**tail_sp, "ws": tail_sp["ws"][:, :1].contiguous()}),
        "producer_x_s_rows_sp": ("moe_shared_producer", {**producer_sp, "x_s": producer_sp["x_s"][:M].contiguous()}),
        "producer_unknown_group": ("moe_shared_producer", {**producer_tp, "group_name": "no_such_group"}),
        "tail_hidden_not_divisible": ("latent_tail", {**tail_tp, "w_up": tail_tp["w_up"][:255].contiguous(),
                                                      "ws": tail_tp["ws"][:, :, :127].contiguous()}),
    }
    outcome = {}
    for name, (op_name, args) in cases.items():
        try:
            getattr(torch.ops.lmf, op_name)(**args)
            outcome[name] = ("no error", "")
        except Exception as exc:  # reported to the parent, which checks type and message
            outcome[name] = (type(exc).__name__, str(exc))
    dist.barrier()
    return outcome


GROUP_CASES = {
    "producer_local_on_2_ranks": r"mode='local' is for R = 1 but group '.*' has 2 ranks",
    "tail_local_on_2_ranks": r"mode='local' is for R = 1 but group '.*' has 2 ranks",
    "tail_ws_4_fragments_tp": r"ws holds 4 fragments along dim 0 but group '.*' has 2 ranks",
    "tail_ws_1_fragment_sp": r"ws holds 1 fragments along dim 1 but group '.*' has 2 ranks",
    "producer_x_s_rows_sp": r"x_s has 4 rows; mode='token_publish' with R = 2 needs 8",
    "producer_unknown_group": r"group_name='no_such_group' names no process group",
    "tail_hidden_not_divisible": r"w_up has H = 255 rows, not divisible by R = 2",
}


def test_group_errors_on_two_gloo_ranks():
    seed, per_rank = multirank.results(2, "tests.test_bad_inputs:group_errors_on_ranks")
    for rank, outcome in enumerate(per_rank):
        assert set(outcome) == set(GROUP_CASES)
        for name, pattern in GROUP_CASES.items():
            kind, message = outcome[name]
            assert kind == LmfInputError.__name__, (rank, seed, name, kind, message)
            assert re.search(pattern, message), (rank, seed, name, message)


def test_id_check_opt_out_is_read_and_keeps_cpu_checked(monkeypatch):
    from latent_moe_fusion.ops.routed.expert_ids_check import device_id_check_enabled

    assert device_id_check_enabled()
    monkeypatch.setenv("LMF_CHECK_IDS", "0")
    assert not device_id_check_enabled()
    # CPU tensors are still checked: there is no sync to save.
    args = _routed(torch.Generator().manual_seed(5))
    args["topk_ids"][1, 2] = E
    with pytest.raises(LmfInputError, match=f"topk_ids holds expert id {E}"):
        torch.ops.lmf.routed_experts(**args)


def test_every_negative_id_is_an_expert_elsewhere():
    """docs/design.md: ids < 0 are skipped (the expert is not on this rank), whatever their value; the range error says so."""
    args = _routed(torch.Generator().manual_seed(6))
    args["topk_ids"][0, 0] = -1
    skipped = torch.ops.lmf.routed_experts(**args)
    for other in (-2, -7, -(2**31)):
        args["topk_ids"][0, 0] = other
        assert torch.equal(torch.ops.lmf.routed_experts(**args), skipped), other
    args["topk_ids"][0, 0] = E
    with pytest.raises(LmfInputError, match=rf"valid: 0..{E - 1}, or any id < 0 for an expert not on this rank"):
        torch.ops.lmf.routed_experts(**args)
