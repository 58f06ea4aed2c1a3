"""Presets load into typed configs; variants, --set overrides and clear errors."""

import pytest

from agentenv.core.config import (ConfigError, FlashReinforceLoss, GRPOLoss, list_presets, load_config, parse_override,
                                  preset_variants)


def test_presets_exist_and_validate():
    names = set(list_presets())
    assert {"alfworld", "python_tool", "demo"} <= names
    for n in names:
        load_config(n)


def test_alfworld_paper_setting():
    c = load_config("alfworld")
    assert c.model.name == "qwen2.5-7b"
    assert (c.loop.batch_size, c.loop.group_size, c.rollout.max_turns) == (64, 1, 50)
    assert c.algo.loss.delta == 1e-3 and c.algo.loss.negative_token_fraction == 0.9 and c.algo.schedule == "constant"
    assert (c.rollout.max_total_tokens, c.rollout.max_generated_tokens) == (16384, 8192)
    assert c.eval.every == 40 and c.eval.samples == 3 and c.eval.splits == ["valid_seen", "valid_unseen"]


def test_python_tool_paper_setting_and_grpo_budget():
    c = load_config("python_tool")
    assert (c.loop.batch_size, c.rollout.max_turns, c.rollout.max_total_tokens, c.rollout.max_generated_tokens) == (
        128, 10, 8192, 6144)
    g = load_config("python_tool", ["grpo"])
    assert (g.loop.batch_size // g.loop.group_size, g.loop.group_size, g.algo.loss.type, g.loop.mode) == (
        32, 4, "grpo", "sync_grpo")
    a = load_config("alfworld", ["grpo"])
    assert (a.loop.batch_size // a.loop.group_size, a.loop.group_size) == (8, 8)


@pytest.mark.parametrize("variant,field,value", [
    ("no_trust", "no_trust", True), ("no_is", "no_is", True), ("token_mean", "token_mean", True),
    ("negative_q09", "negative_token_fraction", 0.9), ("negative_q02", "negative_token_fraction", 0.2)])
def test_variants(variant, field, value):
    for preset in ("alfworld", "python_tool"):
        c = load_config(preset, [variant])
        assert getattr(c.algo.loss, field) == value
        assert c.variants == [variant]


def test_set_overrides_parse_yaml_values():
    c = load_config("demo", [], ["loop.batch_size=4", "algo.lr=1e-5", "eval.splits=[a, b]", "model.device=null",
                                 "env.kwargs.persistent=false"])
    assert c.loop.batch_size == 4 and c.algo.lr == 1e-5 and c.eval.splits == ["a", "b"] and c.model.device is None
    assert c.env.kwargs["persistent"] is False and c.env.kwargs["backend"] == "bubblewrap"  # kwargs merge key by key


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
    with pytest.raises(ConfigError, match=r"algo\.betas.*\[0, 1\)"):
        load_config("demo", [], ["algo.betas=[0.9, 1.0]"])


def test_adamw_settings_reach_the_learners_optimizer():
    from agentenv.trainer.learner import learner_config_from

    c = load_config("demo", [], ["algo.betas=[0.8, 0.99]", "algo.eps=1e-7"])
    lc = learner_config_from(c)
    assert (lc.betas, lc.eps) == ((0.8, 0.99), 1e-7)


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


# The paper's published settings (the reference repository's per-setting files and their common defaults), key by key.
PAPER = {
    "alfworld": {
        "model.name": "qwen2.5-7b", "model.dtype": "bfloat16", "env.train_split": "train", "env.num_tasks": 1024,
        "loop.batch_size": 64, "loop.group_size": 1, "loop.queue_size": 1, "loop.mode": "async",
        "rollout.max_turns": 50, "rollout.max_total_tokens": 16384, "rollout.max_generated_tokens": 8192,
        "rollout.temperature": 1.0, "rollout.top_p": 1.0, "rollout.top_k": 0,
        "algo.loss.delta": 1e-3, "algo.loss.negative_token_fraction": 0.9, "algo.lr": 1e-6, "algo.schedule": "constant",
        "algo.weight_decay": 0.1, "algo.max_grad_norm": 1.0, "loop.total_updates": 200,
        "eval.every": 40, "eval.splits": ["valid_seen", "valid_unseen"], "eval.samples": 3,
        "eval.temperature": 1.0, "eval.top_p": 0.7,
    },
    "python_tool": {
        "model.name": "qwen2.5-7b", "model.dtype": "bfloat16",
        "loop.batch_size": 128, "loop.group_size": 1, "loop.queue_size": 1, "loop.mode": "async",
        "rollout.max_turns": 10, "rollout.max_total_tokens": 8192, "rollout.max_generated_tokens": 6144,
        "rollout.temperature": 1.0, "rollout.top_p": 1.0, "rollout.top_k": 0,
        "algo.loss.delta": 1e-3, "algo.loss.negative_token_fraction": 1.0, "algo.lr": 1e-6, "algo.schedule": "cosine",
        "algo.warmup_ratio": 0.03, "algo.min_lr_ratio": 0.1,
        "eval.every": 100, "eval.at_start": True, "eval.samples": 4, "eval.temperature": 0.7, "eval.top_p": 0.7,
    },
}
VARIANTS = {
    "alfworld": {"no_trust": {"algo.loss.no_trust": True}, "no_is": {"algo.loss.no_is": True},
                 "token_mean": {"algo.loss.token_mean": True}, "negative_q09": {"algo.loss.negative_token_fraction": 0.9},
                 "negative_q02": {"algo.loss.negative_token_fraction": 0.2},
                 "negative_q00": {"algo.loss.negative_token_fraction": 0.0},
                 "grpo": {"algo.loss.type": "grpo", "loop.mode": "sync_grpo", "loop.batch_size": 64, "loop.group_size": 8},
                 "cpu": {"model.backend": "hf", "loop.backend": "local", "launch.gpus": 0,
                         "rollout.max_new_tokens": 128, "eval.episodes": 8}},
    "python_tool": {"no_trust": {"algo.loss.no_trust": True}, "no_is": {"algo.loss.no_is": True},
                    "token_mean": {"algo.loss.token_mean": True}, "negative_q09": {"algo.loss.negative_token_fraction": 0.9},
                    "negative_q02": {"algo.loss.negative_token_fraction": 0.2},
                    "negative_q00": {"algo.loss.negative_token_fraction": 0.0},
                    "constant_length": {"algo.loss.constant_length": 6144},
                    "grpo": {"algo.loss.type": "grpo", "loop.mode": "sync_grpo", "loop.batch_size": 128,
                             "loop.group_size": 4},
                    "cpu": {"model.backend": "hf", "loop.backend": "local", "launch.gpus": 0,
                            "rollout.max_new_tokens": 128, "eval.episodes": 8}},
}


def _get(cfg, dotted):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def test_presets_equal_the_paper_settings_key_by_key():
    for preset, table in PAPER.items():
        c = load_config(preset)
        wrong = {k: (_get(c, k), v) for k, v in table.items() if _get(c, k) != v}
        assert not wrong, f"{preset}: (ours, paper) {wrong}"
        assert set(preset_variants(preset)) == set(VARIANTS[preset])
        for variant, over in VARIANTS[preset].items():
            v = load_config(preset, [variant])
            wrong = {k: (_get(v, k), x) for k, x in over.items() if _get(v, k) != x}
            assert not wrong, f"{preset} --variant {variant}: (ours, paper) {wrong}"


def test_one_turn_limit_and_one_engine_count():
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config("demo", [], ["env.kwargs.max_turns=5"])
    c = load_config("python_tool", [], ["launch.vllm_engines=3"])  # the engine count drives the rollout actors
    assert (c.launch.vllm_engines, c.loop.num_workers) == (3, 3)
    with pytest.raises(ConfigError, match="vllm_engines=2: loop.backend=local"):
        load_config("python_tool", [], ["loop.backend=local", "launch.vllm_engines=2"])
    with pytest.raises(ConfigError, match="needs model.backend=vllm"):
        load_config("python_tool", [], ["model.backend=hf"])


def test_eval_samples_per_split():
    c = load_config("alfworld_demo", [], ["eval.samples={valid_seen: 2, valid_unseen: 8}"])
    assert (c.eval.samples_for("valid_seen"), c.eval.samples_for("valid_unseen")) == (2, 8)
    assert load_config("alfworld_demo", [], ["eval.samples=3"]).eval.samples_for("valid_unseen") == 3
    with pytest.raises(ConfigError, match=r"must name every evaluated split; it lacks \['valid_unseen'\]"):
        load_config("alfworld_demo", [], ["eval.samples={valid_seen: 2}"])
    with pytest.raises(ConfigError, match="plays per task must be >= 1"):
        load_config("alfworld_demo", [], ["eval.samples={valid_seen: 0, valid_unseen: 2}"])
    # the training tasks (no eval.splits) are "train_tasks" in a mapping
    c = load_config("demo", [], ["eval.splits=[]", "eval.samples={train_tasks: 5}"])
    assert c.eval.samples_for(None) == 5


def test_the_loss_is_one_tagged_section():
    c = load_config("alfworld", [], ["algo.loss.delta=0.02"])
    assert c.algo.loss == FlashReinforceLoss(delta=0.02, negative_token_fraction=0.9)
    # a variant that changes the loss's type starts the section afresh: flashreinforce's q does not leak into grpo
    assert load_config("alfworld", ["grpo"]).algo.loss == GRPOLoss()
    # so does --set ...type=, in order with the options that follow it; a bare name is the loss with its defaults
    assert load_config("alfworld", [], ["algo.loss.type=grpo", "algo.loss.clip_eps=0.3"]).algo.loss == GRPOLoss(
        clip_eps=0.3)
    assert load_config("demo", [], ["algo.loss=grpo", "algo.loss.clip_eps=0.1"]).algo.loss == GRPOLoss(clip_eps=0.1)
    assert load_config("demo", [], ["algo.loss={type: grpo, clip_eps: 0.5}"]).algo.loss == GRPOLoss(clip_eps=0.5)
    # a section without a type is the default loss's
    assert load_config({"algo": {"loss": {"no_trust": True}}}).algo.loss == FlashReinforceLoss(no_trust=True)


def test_a_loss_option_error_names_its_key_and_the_losss_options():
    with pytest.raises(ConfigError, match=r"algo\.loss\.clip_eps: unknown key \(valid keys here: type, delta, no_trust"):
        load_config("demo", [], ["algo.loss.clip_eps=0.3"])  # flashreinforce has no clip_eps
    with pytest.raises(ConfigError, match=r"  algo\.loss\.clip_eps: Input should be greater than 0"):
        load_config("demo", [], ["algo.loss=grpo", "algo.loss.clip_eps=0"])
    with pytest.raises(ConfigError, match=r"  algo\.loss: .*token_mean and constant_length"):
        load_config("python_tool", ["constant_length"], ["algo.loss.token_mean=true"])
    with pytest.raises(ConfigError, match=r"algo\.loss\.no_trust: unknown key \(valid keys here: type, clip_eps\)"):
        load_config("demo", ["grpo", "no_trust"])  # an option of another loss


@pytest.mark.parametrize("old,new", [("delta", "algo.loss.delta"), ("no_trust", "algo.loss.no_trust"),
                                     ("negative_token_fraction", "algo.loss.negative_token_fraction"),
                                     ("grpo_clip_eps", "algo.loss.clip_eps")])
def test_an_old_loss_key_fails_with_one_line_naming_the_new_one(old, new):
    with pytest.raises(ConfigError) as e:
        load_config("demo", [], [f"algo.{old}=1"])
    assert f"algo.{old} is now {new}" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=f"algo.{old} is now"):
        load_config({"algo": {old: 1}})  # an old preset file too
