"""Model presets load with the public config numbers; bad tables name their fields."""

from __future__ import annotations

import pytest

from pd_transfer.errors import ConfigError, Reason
from pd_transfer.layout import presets
from pd_transfer.layout.presets import LayerKind, load_preset, model_from_table, preset_names

EXPECTED_PRESETS = {
    "deepseek-v3",
    "gpt-oss-20b",
    "kimi-linear-48b-a3b",
    "llama-3.1-8b",
    "mimo-v2-flash",
    "nemotron-h-4b",
    "qwen3-next-80b-a3b",
}


def test_every_expected_preset_is_listed_and_loads():
    assert EXPECTED_PRESETS <= set(preset_names())
    for name in preset_names():
        spec = load_preset(name)
        assert spec.name == name and spec.num_layers > 0


def test_presets_are_read_from_the_repo_when_not_installed():
    assert presets.preset_dir().name in ("_presets", "models")
    assert (presets.preset_dir() / "llama-3.1-8b.toml").is_file()


def test_llama_is_dense_gqa():
    spec = load_preset("llama-3.1-8b")
    assert spec.layer_ids(LayerKind.ATTENTION) == tuple(range(32))
    assert (spec.attention.num_kv_heads, spec.attention.head_dim) == (8, 128)
    assert spec.kv_dtype == "bfloat16"


def test_qwen3_next_has_full_attention_every_fourth_layer_and_gdn_elsewhere():
    spec = load_preset("qwen3-next-80b-a3b")
    assert spec.layer_ids(LayerKind.ATTENTION) == tuple(range(3, 48, 4))
    assert len(spec.layer_ids(LayerKind.GDN)) == 36
    assert (spec.attention.num_kv_heads, spec.attention.head_dim) == (2, 256)
    assert spec.gdn.conv_dim == 8192 and (spec.gdn.key_dim, spec.gdn.value_dim) == (2048, 4096)
    assert spec.gdn.temporal_dtype == "float32"


def test_deepseek_v3_is_all_mla_with_576_latent():
    spec = load_preset("deepseek-v3")
    assert spec.layer_ids(LayerKind.MLA) == tuple(range(61))
    assert spec.mla.latent_dim == 576


def test_gpt_oss_alternates_sliding_and_full_attention():
    spec = load_preset("gpt-oss-20b")
    assert spec.layer_ids(LayerKind.SLIDING_ATTENTION) == tuple(range(0, 24, 2))
    assert spec.layer_ids(LayerKind.ATTENTION) == tuple(range(1, 24, 2))
    assert spec.sliding_attention.window_tokens == 128
    assert spec.swa_pages_per_request(page_size=16) == 9  # ceil(128/16) + 1
    assert spec.swa_pages_per_request(page_size=64) == 3


def test_nemotron_h_pattern_gives_mamba2_and_four_attention_layers():
    spec = load_preset("nemotron-h-4b")
    assert spec.num_layers == 52
    assert spec.layer_ids(LayerKind.ATTENTION) == (7, 18, 29, 40)
    assert len(spec.layer_ids(LayerKind.MAMBA2)) == 24
    assert (spec.mamba2.num_heads, spec.mamba2.head_dim, spec.mamba2.state_size) == (112, 64, 128)


def test_mimo_v2_flash_has_asymmetric_kv_and_more_swa_heads():
    spec = load_preset("mimo-v2-flash")
    assert spec.layer_ids(LayerKind.ATTENTION) == tuple(range(0, 48, 6))
    assert spec.attention.num_kv_heads == 4 and spec.sliding_attention.num_kv_heads == 8
    for attn in (spec.attention, spec.sliding_attention):
        assert (attn.head_dim, attn.value_head_dim) == (192, 128)


def test_kimi_linear_preset_is_marked_illustrative():
    spec = load_preset("kimi-linear-48b-a3b")
    assert spec.illustrative
    assert spec.layer_ids(LayerKind.MLA) == (3, 7, 11, 15, 19, 23, 26)
    assert len(spec.layer_ids(LayerKind.KDA)) == 20


def test_unknown_preset_lists_known_names():
    with pytest.raises(ConfigError) as info:
        load_preset("llama-9")
    assert info.value.code is Reason.UNKNOWN_PRESET
    assert "llama-3.1-8b" in str(info.value) and "deepseek-v3" in str(info.value)


def _table(**changes):
    table = {
        "name": "m",
        "num_layers": 4,
        "layer_cycle": ["gdn", "attention"],
        "attention": {"num_kv_heads": 8, "head_dim": 128},
        "gdn": {
            "num_key_heads": 16,
            "key_head_dim": 128,
            "num_value_heads": 32,
            "value_head_dim": 128,
            "conv_kernel": 4,
        },
    }
    for key, value in changes.items():
        if value is None:
            table.pop(key)
        else:
            table[key] = value
    return table


def test_model_table_builds_explicit_geometry():
    spec = model_from_table(_table(), "inline")
    assert spec.layer_kinds == (LayerKind.GDN, LayerKind.ATTENTION) * 2
    assert spec.source == "inline"


def test_model_table_reports_every_bad_field_with_its_path():
    table = _table(num_layers=0, attention={"num_kv_heads": 0, "head_dim": 128, "extra": 1}, kv_dtype="fp9")
    with pytest.raises(ConfigError) as info:
        model_from_table(table, "cfg.toml")
    text = str(info.value)
    assert "invalid model table in cfg.toml" in text
    assert "model.num_layers: must be an integer >= 1, got 0" in text
    assert "model.attention.num_kv_heads: must be an integer >= 1, got 0" in text
    assert "model.attention.extra: unknown key; accepted keys: num_kv_heads, head_dim, v_head_dim" in text
    assert "model.kv_dtype: must be one of [" in text and "bfloat16" in text


def test_model_table_names_missing_fields():
    with pytest.raises(ConfigError) as info:
        model_from_table(_table(name=None, gdn={"num_key_heads": 16}), "cfg.toml")
    text = str(info.value)
    assert "model.name: missing (required)" in text
    assert "model.gdn.conv_kernel: missing (required)" in text


def test_model_table_lists_accepted_layer_kinds():
    with pytest.raises(
        ConfigError,
        match=r"model.layer_cycle\[1\]: unknown layer kind 'ssm'; "
        r"accepted: attention, sliding_attention, mla",
    ):
        model_from_table(_table(layer_cycle=["gdn", "ssm"]), "cfg.toml")


def test_model_table_needs_geometry_for_every_used_kind():
    with pytest.raises(ConfigError, match="layers of kind 'gdn' need model.gdn"):
        model_from_table(_table(gdn=None), "cfg.toml")


def test_model_table_refuses_two_layer_descriptions():
    with pytest.raises(ConfigError, match="give exactly one of layer_kinds, layer_cycle, layer_pattern"):
        model_from_table(_table(layer_kinds=["attention"] * 4), "cfg.toml")


def test_model_table_pattern_length_must_match_num_layers():
    with pytest.raises(ConfigError, match="model.layer_pattern: gives 3 layers but model.num_layers is 4"):
        model_from_table(_table(layer_cycle=None, gdn=None, layer_pattern="*-*"), "cfg.toml")
