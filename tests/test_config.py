import math

import pytest

from latent_moe_fusion import ConfigError, KimiK3MoEConfig


def test_defaults_are_kimi_k3():
    cfg = KimiK3MoEConfig()
    assert (cfg.hidden_size, cfg.latent_size, cfg.num_experts, cfg.top_k) == (7168, 3584, 896, 16)
    assert (cfg.moe_intermediate_size, cfg.shared_intermediate_size) == (3072, 6144)
    assert (cfg.rms_norm_eps, cfg.situ_beta, cfg.situ_linear_beta, cfg.routed_scaling_factor) == (1e-5, 4.0, 25.0, 1.0)
    for world in (1, 2, 4, 8):
        cfg.validate_for(world, "mxfp4")
        cfg.validate_for(world, "bf16")


def test_tiny_is_legal_up_to_four_ranks():
    cfg = KimiK3MoEConfig.tiny()
    assert (cfg.hidden_size, cfg.latent_size, cfg.num_experts, cfg.top_k) == (256, 128, 16, 4)
    assert (cfg.moe_intermediate_size, cfg.shared_intermediate_size) == (64, 128)
    for world in (1, 2, 4):
        for weight_format in ("bf16", "mxfp4"):
            cfg.validate_for(world, weight_format, ep_size=world)


def test_replace_revalidates():
    assert KimiK3MoEConfig.tiny().replace(top_k=2).top_k == 2
    with pytest.raises(ConfigError, match="top_k"):
        KimiK3MoEConfig.tiny().replace(top_k=17)


@pytest.mark.parametrize(
    "world, changes, match",
    [
        (3, {}, "shared_intermediate_size 128 is not divisible by the TP world size 3"),
        (4, {"shared_intermediate_size": 130}, "shared_intermediate_size 130 is not divisible"),
        (4, {"hidden_size": 250}, "hidden_size 250 is not divisible by the TP world size 4"),
        (0, {}, "world size must be >= 1"),
    ],
)
def test_tp_divisibility(world, changes, match):
    with pytest.raises(ConfigError, match=match):
        KimiK3MoEConfig.tiny().replace(**changes).validate_for(world)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"latent_size": 48}, "latent_size = 48 is not divisible by 32"),
        ({"moe_intermediate_size": 40}, "moe_intermediate_size = 40 is not divisible by 32"),
    ],
)
def test_mxfp4_needs_blocks_of_32(changes, match):
    cfg = KimiK3MoEConfig.tiny().replace(**changes)
    cfg.validate_for(1, "bf16")  # legal for dense weights
    with pytest.raises(ConfigError, match=match):
        cfg.validate_for(1, "mxfp4")


def test_bad_weight_format_and_ep_size():
    cfg = KimiK3MoEConfig.tiny()
    with pytest.raises(ConfigError, match="weight_format must be 'bf16' or 'mxfp4', got 'fp8'"):
        cfg.validate_for(1, "fp8")
    with pytest.raises(ConfigError, match="expert-parallel size 3"):
        cfg.validate_for(1, "bf16", ep_size=3)
    with pytest.raises(ConfigError, match="expert-parallel size 0"):
        cfg.validate_for(1, "bf16", ep_size=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("hidden_size", 0),
        ("latent_size", -128),
        ("num_experts", 16.0),
        ("top_k", True),
        ("moe_intermediate_size", "64"),
        ("shared_intermediate_size", None),
    ],
)
def test_sizes_must_be_positive_ints(field, value):
    with pytest.raises(ConfigError, match=f"KimiK3MoEConfig.{field} must be a positive int"):
        KimiK3MoEConfig.tiny().replace(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("rms_norm_eps", 0.0),
        ("situ_beta", -4.0),
        ("situ_linear_beta", math.nan),
        ("routed_scaling_factor", math.inf),
        ("rms_norm_eps", "1e-5"),
    ],
)
def test_scalars_must_be_finite_positive(field, value):
    with pytest.raises(ConfigError, match=f"KimiK3MoEConfig.{field} must be a finite number > 0"):
        KimiK3MoEConfig.tiny().replace(**{field: value})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)
