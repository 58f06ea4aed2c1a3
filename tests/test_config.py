"""Presets load into typed configs; variants, --set overrides and clear errors."""

import pytest

from agentenv.config import ConfigError, list_presets, load_config, parse_override


def test_presets_exist_and_validate():
    names = set(list_presets())
    assert {"alfworld", "python_tool", "demo"} <= names
    for n in names:
        load_config(n)


def test_alfworld_paper_setting():
    c = load_config("alfworld")
    assert c.model.name == "qwen2.5-7b"
    assert (c.loop.batch_size, c.loop.group_size, c.rollout.max_turns) == (64, 1, 50)
    assert c.algo.delta == 1e-3 and c.algo.negative_token_fraction == 0.9 and c.algo.schedule == "constant"
    assert (c.rollout.max_total_tokens, c.rollout.max_generated_tokens) == (16384, 8192)
    assert c.eval.every == 40 and c.eval.samples == 3 and c.eval.splits == ["valid_seen", "valid_unseen"]


def test_python_tool_paper_setting_and_grpo_budget():
    c = load_config("python_tool")
    assert (c.loop.batch_size, c.rollout.max_turns, c.rollout.max_total_tokens, c.rollout.max_generated_tokens) == (
        128, 10, 8192, 6144)
    g = load_config("python_tool", ["grpo"])
    assert (g.loop.batch_size // g.loop.group_size, g.loop.group_size, g.algo.loss, g.loop.mode) == (
        32, 4, "grpo", "sync_grpo")
    a = load_config("alfworld", ["grpo"])
    assert (a.loop.batch_size // a.loop.group_size, a.loop.group_size) == (8, 8)


@pytest.mark.parametrize("variant,field,value", [
    ("no_trust", "no_trust", True), ("no_is", "no_is", True), ("token_mean", "token_mean", True),
    ("negative_q09", "negative_token_fraction", 0.9), ("negative_q02", "negative_token_fraction", 0.2)])
def test_variants(variant, field, value):
    for preset in ("alfworld", "python_tool"):
        c = load_config(preset, [variant])
        assert getattr(c.algo, field) == value
        assert c.variants == [variant]


def test_set_overrides_parse_yaml_values():
    c = load_config("demo", [], ["loop.batch_size=4", "algo.lr=1e-5", "eval.splits=[a, b]", "model.device=null",
                                 "env.kwargs.backend=subprocess"])
    assert c.loop.batch_size == 4 and c.algo.lr == 1e-5 and c.eval.splits == ["a", "b"] and c.model.device is None
    assert c.env.kwargs["backend"] == "subprocess" and c.env.kwargs["max_turns"] == 3  # kwargs merge key by key


def test_unknown_key_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"loop\.batchsize: unknown key .*batch_size"):
        load_config("demo", [], ["loop.batchsize=4"])
    with pytest.raises(ConfigError, match="bogus"):
        load_config("demo", [], ["bogus=1"])


def test_bad_values_are_clear_errors():
    with pytest.raises(ConfigError, match=r"loop\.batch_size"):
        load_config("demo", [], ["loop.batch_size=0"])
    with pytest.raises(ConfigError, match=r"algo\.loss"):
        load_config("demo", [], ["algo.loss=ppo"])
    with pytest.raises(ConfigError, match=r"rollout\.top_p"):
        load_config("demo", [], ["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match="group_size"):
        load_config("demo", [], ["loop.group_size=4"])  # async is one rollout per prompt


def test_unknown_variant_and_preset():
    with pytest.raises(ConfigError, match="no variant 'nope'.*no_trust"):
        load_config("alfworld", ["nope"])
    with pytest.raises(ConfigError, match="no preset named"):
        load_config("does-not-exist")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("novalue")


def test_yaml_round_trip(tmp_path):
    c = load_config("alfworld", ["no_trust"], ["loop.total_updates=3"])
    p = tmp_path / "c.yaml"
    p.write_text(c.to_yaml())
    again = load_config(str(p))
    assert again.to_dict() == c.to_dict()
