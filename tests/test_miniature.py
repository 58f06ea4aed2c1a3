"""Learning in miniature: the ALFWorld demo's code path on the shipped sample (2 updates), its pieces (noisy expert,
expert demos in the runtime's token format, the ALFWorld-aware tiny vocabulary), the report's confidence intervals,
and the pooling of several RL runs from one warm start (``benchmarks/alfworld_pooled.py``) (real model, learner,
games). The ablations' smoke is tests/test_ablations.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv.run.report import (before_after_table, difference_interval, paired_difference_interval,
                             pool_task_successes, runs_and_tasks_interval, wilson_interval)

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ confidence intervals
@given(n=st.integers(1, 2000), data=st.data())
@settings(max_examples=200, deadline=None)
def test_wilson_interval_contains_the_estimate_and_stays_in_0_1(n, data):
    s = data.draw(st.integers(0, n))
    lo, hi = wilson_interval(s, n)
    assert 0.0 <= lo <= s / n <= hi <= 1.0
    assert hi - lo > 0
    lo4, hi4 = wilson_interval(4 * s, 4 * n)  # same proportion, 4x the episodes: a narrower interval
    assert hi4 - lo4 < hi - lo


def test_wilson_interval_known_value_and_bad_input():
    lo, hi = wilson_interval(8, 10)  # textbook value: 0.490 .. 0.943
    assert lo == pytest.approx(0.4902, abs=1e-3) and hi == pytest.approx(0.9433, abs=1e-3)
    with pytest.raises(ValueError):
        wilson_interval(0, 0)
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


@given(n1=st.integers(1, 500), n2=st.integers(1, 500), data=st.data())
@settings(max_examples=200, deadline=None)
def test_difference_interval_contains_the_difference(n1, n2, data):
    s1, s2 = data.draw(st.integers(0, n1)), data.draw(st.integers(0, n2))
    lo, hi = difference_interval(s1, n1, s2, n2)
    d = s2 / n2 - s1 / n1
    assert -1.0 - 1e-9 <= lo <= d + 1e-12 and d - 1e-12 <= hi <= 1.0 + 1e-9


def test_difference_interval_excludes_zero_only_for_a_real_gap():
    assert difference_interval(10, 100, 40, 100)[0] > 0  # 0.10 -> 0.40 over 100 episodes each: clearly up
    lo, hi = difference_interval(10, 20, 12, 20)  # 0.50 -> 0.60 over 20 each: not resolved
    assert lo < 0 < hi


@given(tasks=st.integers(2, 60), samples=st.integers(1, 8), data=st.data())
@settings(max_examples=100, deadline=None)
def test_paired_interval_contains_the_mean_task_change(tasks, samples, data):
    counts = st.lists(st.integers(0, samples), min_size=tasks, max_size=tasks)
    b, a = data.draw(counts), data.draw(counts)
    lo, hi, n = paired_difference_interval({str(j): [b[j], samples] for j in range(tasks)},
                                           {str(j): [a[j], samples] for j in range(tasks)}, resamples=2000)
    d = (sum(a) - sum(b)) / (tasks * samples)
    assert n == tasks and -1.0 <= lo <= d + 1e-9 and d - 1e-9 <= hi <= 1.0
    same = {str(j): [b[j], samples] for j in range(tasks)}
    assert paired_difference_interval(same, same)[:2] == (0.0, 0.0)  # nothing changed on any task: no doubt at all


def test_paired_interval_covers_zero_when_nothing_changed():
    """The null holds (each task keeps its own success probability, from hopeless to easy): the 95% interval
    must contain 0 in about 95% of repeated evaluations -- the task-level resampling is what makes that true."""
    import numpy as np

    rng = np.random.default_rng(0)
    covered, trials = 0, 300
    for t in range(trials):
        p = rng.beta(0.4, 1.2, size=42)  # ALFWorld-like: most games rarely solved, a few often
        b, a = rng.binomial(4, p), rng.binomial(4, p)
        lo, hi, _ = paired_difference_interval({str(j): [int(b[j]), 4] for j in range(42)},
                                               {str(j): [int(a[j]), 4] for j in range(42)}, resamples=2000, seed=t)
        covered += lo <= 0 <= hi
    assert 0.90 <= covered / trials <= 0.99


def test_paired_interval_is_tighter_than_unpaired_when_tasks_differ_and_is_reported():
    # 20 tasks always solved, 15 never, 5 newly solved after RL: the hard/easy split is the same before and after,
    # so pairing removes it; the unpaired interval has to carry it as noise
    before = {str(j): [4 if j < 20 else 0, 4] for j in range(40)}
    after = {str(j): [4 if j < 25 else 0, 4] for j in range(40)}
    lo, hi, n = paired_difference_interval(before, after)
    nlo, nhi = difference_interval(80, 160, 100, 160)
    assert n == 40 and 0 < lo < 0.125 < hi and hi - lo < nhi - nlo
    with pytest.raises(ValueError, match="at least two tasks"):
        paired_difference_interval({"0": [1, 4]}, {"0": [2, 4], "1": [0, 4]})
    with pytest.raises(ValueError, match="successes"):
        paired_difference_interval({"0": [5, 4], "1": [0, 4]}, {"0": [2, 4], "1": [0, 4]})
    ev = {"split": "valid_unseen", "episodes": 160}
    lines = before_after_table([{**ev, "success_rate": 0.5, "successes": 80, "task_successes": before}],
                               [{**ev, "success_rate": 0.625, "successes": 100, "task_successes": after}], 48)
    text = "\n".join(lines)
    assert "160 episodes of 40 tasks" in text and f"[{lo:+.2f}, {hi:+.2f}]" in text and "paired" in text
    # an eval without per-task counts (an older eval.jsonl) falls back to Newcombe's interval, and says so
    text = "\n".join(before_after_table([{**ev, "success_rate": 0.5, "successes": 80}],
                                        [{**ev, "success_rate": 0.625, "successes": 100}], 48))
    assert f"[{nlo:+.2f}, {nhi:+.2f}]" in text and "Newcombe" in text


# ------------------------------------------------------------------------------------------- the tiny vocabulary
def test_alfworld_vocabulary_encodes_alfworld_text_in_fewer_tokens():
    from agentenv.samplers.tiny import small_tokenizer

    text = ("You arrive at countertop 1. On the countertop 1, you see a apple 1, a dishsponge 2, and a saltshaker 1."
            "\n\nYour task is to: look at pillow under the desklamp.\n\nAdmissible actions:\ntake apple 1 from countertop 1")
    small, alf = small_tokenizer("small"), small_tokenizer("small-alfworld")
    n_small, n_alf = len(small(text)["input_ids"]), len(alf(text)["input_ids"])
    assert n_alf < 0.6 * n_small, (n_small, n_alf)
    assert alf.decode(alf(text)["input_ids"]) == text  # lossless
    assert len(alf(" desklamp")["input_ids"]) == 1  # a word after a space, as in the game text


def test_alfworld_vocabulary_writes_a_command_with_the_same_tokens_as_the_admissible_list():
    """Copying a listed command is then one lookup per token: the tags are whole tokens, and neither the tag nor a
    space fuses with the command's words or numbers."""
    from agentenv.samplers.tiny import small_tokenizer

    tok = small_tokenizer("small-alfworld")
    for command in ("take alarmclock 1 from sidetable 2", "move pillow 10 to armchair 1", "go to desk 1", "look"):
        listed = tok(f"Admissible actions:\n{command}\nhelp")["input_ids"]
        acted = tok(f"<action>{command}</action>")["input_ids"]
        assert acted[0] == tok.convert_tokens_to_ids("<action>") and acted[-1] == tok.convert_tokens_to_ids("</action>")
        body = acted[1:-1]
        assert any(listed[i:i + len(body)] == body for i in range(len(listed))), (command, body)
        assert tok.decode(acted) == f"<action>{command}</action>"
    assert [tok.decode([i]) for i in tok(" 12")["input_ids"]] == [" 12"]
    with pytest.raises(ValueError, match="small vocab"):
        small_tokenizer("nope")


def test_alfworld_vocabulary_is_frozen():
    """The small-alfworld corpus (and so the vocabulary every tiny-bpe-alfworld model is built over) never changes
    silently: not when the env's prompt is reworded (tiny.py keeps its own copy), not when the cache is rebuilt."""
    import hashlib

    from agentenv.samplers import tiny

    corpus = hashlib.sha256("\x00".join(tiny._alfworld_corpus()).encode()).hexdigest()
    assert corpus == "19109dfa9d633825783f1308ec4d07f4973700f40250de8fce85051b92b9c559"
    vocab = sorted(tiny.small_tokenizer("small-alfworld").get_vocab().items())
    assert hashlib.sha256(json.dumps(vocab).encode()).hexdigest() == \
        "9df8e8cfdb8655b00ec216def11a5234f78facb646bfb1004353d24175b70083"


# ------------------------------------------------------------------------------------------------ plan and CLI
def test_expert_demos_need_an_env_with_an_expert(capsys):
    from agentenv.cli import main

    assert main(["run", "--preset", "demo", "--set", "sft.demos=expert", "--dry-run"]) != 0
    out = capsys.readouterr().out
    assert "sft demos" in out and "has no scripted expert" in out


def test_demo_env_choice_is_checked(capsys):
    from agentenv.cli import main

    with pytest.raises(SystemExit):
        main(["demo", "--env", "guess"])
    assert "invalid choice" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------- ALFWorld parts
alfworld = pytest.importorskip("alfworld", reason="alfworld is not installed (pip install 'agentenv[alfworld]')")


def test_noisy_expert_takes_detours_and_still_wins():
    from agentenv.envs.alfworld import SAMPLE_DIR, ALFWorldEnv
    from agentenv.envs.alfworld_expert import ALFWorldExpert
    from agentenv.core.runtime import EpisodeSpec, RolloutConfig, run_episode

    env = ALFWorldEnv("train", SAMPLE_DIR, max_turns=40, expert=True, task_types=["pick_and_place"])
    try:
        clean = run_episode(env, ALFWorldExpert(), RolloutConfig(max_turns=41), EpisodeSpec(options={"game": 0}))
        noisy = run_episode(env, ALFWorldExpert(noise=0.5, seed=3), RolloutConfig(max_turns=41),
                            EpisodeSpec(options={"game": 0}))
    finally:
        env.close()
    assert clean.success and noisy.success
    assert noisy.num_turns > clean.num_turns  # the detours cost turns; the replanning expert recovers
    with pytest.raises(ValueError, match="noise"):
        ALFWorldExpert(noise=1.0)


def _demo_cfg(tmp_path, *extra):
    from agentenv.core.config import load_config

    return load_config("alfworld_demo", [], [
        f"run.dir={tmp_path}", "model.name=tiny-bpe-alfworld:64x2", "sft.demos=expert", "sft.num_demos=4",
        "sft.epochs=1", "sft.batch_size=4", "sft.expert_noise=0.0", "loop.total_updates=2", "loop.batch_size=2",
        "loop.concurrency=2", "eval.samples=1", "run.tensorboard=false", *extra])


def test_expert_demos_are_the_runtime_token_format(tmp_path):
    """The demos SFT trains on are the runtime's sequences: the same prompt as a real rollout of the same game."""
    from transformers import AutoTokenizer

    from agentenv.core.chat import ChatSequence
    from agentenv.samplers.models import resolve_model
    from agentenv.run.sft import prepare_demos
    from agentenv.run.train import expert_demos

    cfg = _demo_cfg(tmp_path)
    trajs = expert_demos(cfg, tmp_path / "demos.jsonl", progress=False, echo=lambda *_: None)
    assert len(trajs) == 4 and all(t.success for t in trajs)
    assert {t.task_type for t in trajs} <= {"pick_and_place", "look_at_obj_in_light"}
    assert all(t.num_turns <= cfg.rollout.max_turns for t in trajs)
    assert len((tmp_path / "demos.jsonl").read_text().splitlines()) == 4
    tok = AutoTokenizer.from_pretrained(resolve_model(cfg.model.name).path)
    demos = prepare_demos(trajs, tok, max_tokens=cfg.rollout.max_total_tokens)
    first = demos[0]
    seq = ChatSequence(tok)
    seq.start([m for m in first.messages[:2]], None)  # system + first observation, as the runtime renders them
    assert first.token_ids[:len(seq.token_ids)] == seq.token_ids
    assert not any(first.action_mask[:len(seq.token_ids)])
    policy_text = tok.decode([i for i, a in zip(first.token_ids, first.action_mask) if a])
    assert policy_text.count("<action>") == first.num_turns


def test_expert_demos_without_a_win_stop_with_the_fix(tmp_path):
    from agentenv.run.train import LaunchError, expert_demos

    cfg = _demo_cfg(tmp_path, "rollout.max_turns=1")
    with pytest.raises(LaunchError, match="rollout.max_turns"):
        expert_demos(cfg, tmp_path / "demos.jsonl", progress=False, echo=lambda *_: None)


def test_shipped_demo_games_unpack_once_into_the_cache(tmp_path, monkeypatch):
    from agentenv.envs.alfworld import DEMO_ARCHIVE, list_games, resolve_data_root

    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    root = resolve_data_root("builtin:demo")
    assert root.parent == tmp_path.resolve() and root.name.startswith("alfworld-demo-")
    sizes = {s: len(list_games(s, "builtin:demo")) for s in ("train", "valid_seen", "valid_unseen")}
    assert sizes == {"train": 128, "valid_seen": 48, "valid_unseen": 42}  # every eval game of the two task types
    assert {g.split("/")[2].split("-")[0] for g in list_games("train", "builtin:demo")} == {
        "pick_and_place_simple", "look_at_obj_in_light"}
    assert resolve_data_root("builtin:demo") == root and len(list(tmp_path.iterdir())) == 1  # unpacked once
    assert DEMO_ARCHIVE.stat().st_size < 1_000_000
    with pytest.raises(ValueError, match="builtin:sample or builtin:demo"):
        resolve_data_root("builtin:nope")


def test_shipped_demos_are_what_the_env_says_today():
    """The shipped demos are text; replaying their actions on the same games must give exactly their observations
    (system prompt included) and their outcome, or the SFT warm start would imitate an env that no longer exists.
    Both players play every train game once: the walkthrough wins each, the searcher wins some."""
    from agentenv.envs.alfworld import ALFWorldEnv
    from agentenv.run.sft import demos_path
    from agentenv.core.trajectory import iter_jsonl

    cfg = yaml.safe_load((REPO / "configs" / "alfworld_demo.yaml").read_text())
    demos = list(iter_jsonl(demos_path(cfg["sft"]["demos"])))
    assert len(demos) == cfg["sft"]["num_demos"] == 2 * 1098
    by_player = {p: {d.task: d for d in demos if d.meta["player"] == p} for p in ("walkthrough", "searcher")}
    assert all(len(v) == 1098 for v in by_player.values())
    assert all(d.success for d in by_player["walkthrough"].values())
    searcher_wins = sum(d.success for d in by_player["searcher"].values())
    assert 0.1 * 1098 < searcher_wins < 1098  # it searches: it wins some and runs out of turns on others
    kw = {**cfg["env"]["kwargs"], "max_turns": cfg["rollout"]["max_turns"]}
    env = ALFWorldEnv("train", **kw)
    replayed = 0
    try:
        for game in env.games[::16]:  # 8 of the 128 shipped train games, both task types, both players
            for player, shipped in by_player.items():
                d = shipped[game]
                obs, info = env.reset(options={"game": game})
                msgs = [m for m in d.messages if m["role"] in ("system", "user", "assistant")]
                assert msgs[0] == {"role": "system", "content": info["system"]} and msgs[1]["content"] == obs
                for i in range(2, len(msgs) - 1, 2):
                    obs, reward, terminated, truncated, info = env.step(msgs[i]["content"])
                    assert msgs[i + 1]["content"] == obs, (game, player, i)
                assert (terminated or truncated) and info["success"] == d.success, (game, player)
                replayed += 1
    finally:
        env.close()
    assert replayed == 16


def test_sft_context_loss_adds_the_observation_tokens_nll():
    import torch

    from agentenv.samplers.models import resolve_model
    from agentenv.run.sft import sft_loss, trajectory_from_messages
    from agentenv.trainer.batch import collate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model("tiny-bpe-alfworld:64x2").path
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    chats = [[{"role": "user", "content": "You arrive at desk 1.\n\nAdmissible actions:\nlook\ngo to bed 1"},
              {"role": "assistant", "content": "<action>look</action>"}],
             [{"role": "user", "content": "Your task is to: put a pen in desk."},
              {"role": "assistant", "content": "<action>go to desk 1</action>"},
              {"role": "user", "content": "You arrive at desk 1."}, {"role": "assistant", "content": "<action>look</action>"}]]
    batch = collate([trajectory_from_messages(tok, c) for c in chats], pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        logp = torch.log_softmax(model(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float(), -1)
        nll = -logp.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
        act, real = batch.action_mask[:, 1:], batch.attention_mask[:, 1:]
        want_action, want_context = nll[act].mean(), nll[real & ~act].mean()
        assert float(sft_loss(model, batch)) == pytest.approx(float(want_action), rel=1e-5)
        assert float(sft_loss(model, batch, 0.5)) == pytest.approx(float(want_action + 0.5 * want_context), rel=1e-5)


def test_alfworld_demo_two_updates_on_the_shipped_games(tmp_path, monkeypatch, capsys):
    """`agentenv demo --env alfworld` end to end on the shipped games, 2 updates: shipped expert demos -> SFT ->
    eval on valid_seen and valid_unseen -> FlashREINFORCE -> eval again -> the before/after table with intervals."""
    from agentenv.cli import main

    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    sets = ["model.name=tiny-bpe-alfworld:64x2", "sft.num_demos=8", "sft.epochs=1", "sft.batch_size=4",
            "loop.total_updates=2", "loop.batch_size=2", "loop.concurrency=2", "eval.episodes=2",
            "eval.samples={valid_seen: 1, valid_unseen: 2}", "env.num_tasks=4", "run.tensorboard=false"]
    argv = ["demo", "--env", "alfworld", "--no-progress", "--run-dir", str(tmp_path / "run")]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 0
    assert ("evaluation before and after RL, plays per task: valid_seen 1, valid_unseen 2, 2 samplers at once"
            in capsys.readouterr().out)
    run = tmp_path / "run"
    res = json.loads((run / "demo_result.json").read_text())
    from agentenv.core.metrics import read_metrics

    final_version = read_metrics(run)[-1]["policy_version"]  # real optimizer steps only (zero-signal ones skip)
    # the preset averages its last 12 updates' weights; this run has 2, so both: the mean is a version of its own
    assert json.loads((run / "summary.json").read_text())["summary"]["averaged_updates"] == 2
    assert "  (after: the mean of the weights after updates 1-2)" in res["table"]
    assert set(res["before"]) == set(res["after"]) == {"valid_seen", "valid_unseen"}
    for split, plays in (("valid_seen", 1), ("valid_unseen", 2)):  # eval.samples per split
        b = res["before"][split]
        assert b["episodes"] == 2 * plays and b["policy_versions"] == [0]
        # one [successes, episodes] per eval game, the same games before and after: the change is paired by game
        assert b["task_successes"].keys() == res["after"][split]["task_successes"].keys() == {"0", "1"}
        assert [n for _, n in b["task_successes"].values()] == [plays, plays]
        assert sum(s for s, _ in b["task_successes"].values()) == b["successes"]
        assert res["after"][split]["policy_versions"] == [final_version + 1]  # the learner's weights at the end
    assert any("95% Wilson" in line for line in res["table"]) and any("2 episodes of 2 tasks" in x for x in res["table"])
    assert any("4 episodes of 2 tasks" in x for x in res["table"])
    assert any(line.strip().startswith("valid_unseen") for line in res["table"])
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in recs if "event" not in r] == [1, 2]
    assert (run / "sft_model" / "config.json").exists() and (run / "curves.png").exists()


# ------------------------------------------------------------------------------------ pooling RL runs (one warm start)
def test_pooled_counts_are_per_task_sums_and_bad_evaluations_are_refused():
    evs = [{"split": "s", "task_successes": {"0": [1, 4], "1": [0, 4]}},
           {"split": "s", "task_successes": {"0": [3, 8], "2": [8, 8]}}]
    assert pool_task_successes(evs) == {"0": [4, 12], "1": [0, 4], "2": [8, 8]}
    with pytest.raises(ValueError, match="nothing to pool"):
        pool_task_successes([])
    with pytest.raises(ValueError, match="no per-task counts"):
        pool_task_successes([{"split": "s", "update": 0, "successes": 1, "episodes": 4}])
    with pytest.raises(ValueError, match="at least one RL run"):
        runs_and_tasks_interval({"0": [1, 4], "1": [0, 4]}, [])
    with pytest.raises(ValueError, match="successes"):
        runs_and_tasks_interval({"0": [1, 4], "1": [0, 4]}, [{"0": [5, 4], "1": [0, 4]}])


@given(tasks=st.integers(2, 30), samples=st.integers(1, 8), data=st.data())
@settings(max_examples=50, deadline=None)
def test_runs_and_tasks_interval_of_one_run_is_the_paired_interval(tasks, samples, data):
    counts = st.lists(st.integers(0, samples), min_size=tasks, max_size=tasks)
    b, a = data.draw(counts), data.draw(counts)
    before = {str(j): [b[j], samples] for j in range(tasks)}
    after = {str(j): [a[j], samples] for j in range(tasks)}
    lo, hi, n = runs_and_tasks_interval(before, [after], resamples=2000, seed=3)
    assert (lo, hi, n) == pytest.approx(paired_difference_interval(before, after, resamples=2000, seed=3))
    assert runs_and_tasks_interval(before, [before, before])[:2] == (0.0, 0.0)  # no run changed anything


def test_one_lucky_run_does_not_make_the_pool_significant_when_runs_are_resampled():
    """Three runs that changed nothing and one that gained +0.3 on every game: pooled as one policy the gain looks
    certain; resampling the runs as well says it may be luck."""
    import numpy as np

    rng = np.random.default_rng(1)
    p = rng.beta(0.4, 1.2, size=42)
    before = {str(j): [int(rng.binomial(16, p[j])), 16] for j in range(42)}
    afters = [{str(j): [int(rng.binomial(8, p[j])), 8] for j in range(42)} for _ in range(3)]
    afters.append({str(j): [int(rng.binomial(8, min(1.0, p[j] + 0.3))), 8] for j in range(42)})
    lo1, _, _ = paired_difference_interval(before, pool_task_successes([{"task_successes": a} for a in afters]))
    lo2, hi2, _ = runs_and_tasks_interval(before, afters)
    assert lo1 > 0 and lo2 < 0 < hi2


def test_nested_interval_of_one_warm_start_is_the_runs_and_tasks_interval_and_a_lucky_warm_start_is_not_evidence():
    """Runs grouped by warm start, each against its own warm start: with one group it is runs_and_tasks_interval;
    with three warm starts of which one happened to be weak (so all its runs "gain"), resampling the warm starts too
    keeps 0 inside the interval, which is wider than the one that treats the nine runs as independent."""
    import numpy as np

    from agentenv.run.report import nested_paired_interval

    rng = np.random.default_rng(2)
    p = rng.beta(0.6, 1.2, size=40)

    def ev(q, n=4):
        return {str(j): [int(rng.binomial(n, min(1.0, max(0.0, q[j])))), n] for j in range(40)}

    before, afters = ev(p), [ev(p) for _ in range(3)]
    change, lo, hi, n = nested_paired_interval([[(before, a) for a in afters]], resamples=2000, seed=3)
    assert (lo, hi, n) == pytest.approx(runs_and_tasks_interval(before, afters, resamples=2000, seed=3))
    assert change == pytest.approx(np.mean([[a[k][0] / 4 - before[k][0] / 4 for k in before] for a in afters]))
    weak = ev(p - 0.3)  # a warm start that came out weak: every run from it "gains" 0.3 back
    groups = [[(ev(p), ev(p)) for _ in range(3)] for _ in range(2)] + [[(weak, ev(p)) for _ in range(3)]]
    _, lo_n, hi_n, _ = nested_paired_interval(groups)
    _, lo_flat, hi_flat, _ = nested_paired_interval([[pair] for g in groups for pair in g])
    assert lo_n < 0 < hi_n and hi_n - lo_n > hi_flat - lo_flat
    with pytest.raises(ValueError, match="at least one"):
        nested_paired_interval([[], []])


def test_nested_paired_test_holds_its_level_under_no_change_and_finds_a_real_one():
    """The bootstrap test behind the ALFWorld study's verdicts: with 3 warm starts x 3 runs x 45 games and RL that
    changes nothing (each run's game rates its warm start's, plus noise of mean 0), it rejects at most about as
    often as its level says; a gain of 0.15 on every game is found every time; and p agrees with the interval."""
    import numpy as np

    from agentenv.run.report import nested_paired_interval, nested_paired_test

    rng = np.random.default_rng(0)

    def study(gain: float) -> list:
        base = rng.beta(2, 3, size=45)  # away from 0 and 1, so noise does not shift a rate by clipping
        groups = []
        for _ in range(3):
            warm = np.clip(base + rng.normal(0, 0.05, 45), 0, 1)
            before = {str(j): [int(rng.binomial(8, warm[j])), 8] for j in range(45)}
            runs = [np.clip(warm + gain + rng.normal(0, 0.05, 45), 0, 1) for _ in range(3)]
            groups.append([(before, {str(j): [int(rng.binomial(4, r[j])), 4] for j in range(45)}) for r in runs])
        return groups

    null = [nested_paired_test(study(0.0), resamples=2000, seed=i) for i in range(100)]
    assert np.mean([t["p"] <= 0.05 for t in null]) <= 0.10
    for t in null:  # p <= 0.05 exactly when the 95% interval leaves out 0 (up to one replicate's granularity)
        assert (t["p"] <= 0.05) == (t["low"] > 0 or t["high"] < 0) or abs(t["p"] - 0.05) < 2e-3
    real = [nested_paired_test(study(0.15), resamples=2000, seed=i) for i in range(20)]
    assert all(t["p"] < 0.01 and t["low"] > 0 for t in real)
    g = study(0.1)
    t = nested_paired_test(g)
    assert (t["change"], t["low"], t["high"], t["tasks"]) == nested_paired_interval(g)


def test_runs_and_tasks_interval_covers_zero_when_nothing_changed():
    import numpy as np

    rng = np.random.default_rng(0)
    covered, trials = 0, 200
    for t in range(trials):
        p = rng.beta(0.4, 1.2, size=42)
        before = {str(j): [int(rng.binomial(8, p[j])), 8] for j in range(42)}
        afters = [{str(j): [int(rng.binomial(4, p[j])), 4] for j in range(42)} for _ in range(3)]
        lo, hi, _ = runs_and_tasks_interval(before, afters, resamples=2000, seed=t)
        covered += lo <= 0 <= hi
    assert 0.90 <= covered / trials <= 1.0


def test_pooled_benchmark_smoke_on_the_shipped_games(tmp_path, monkeypatch):
    """benchmarks/alfworld_pooled.py end to end: warm start evaluated once, two RL runs from it, the pooled report;
    a second invocation reuses every finished evaluation instead of running again."""
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    spec = importlib.util.spec_from_file_location("alfworld_pooled", REPO / "benchmarks" / "alfworld_pooled.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "study"
    assert mod.main(["run", "--smoke", "--out", str(out)]) == 0
    res = json.loads((out / "pooled.json").read_text())
    runs = [mod.read_evals(out / f"rl_seed{i}", "valid_unseen", 1) for i in range(2)]
    seeds = [yaml.safe_load((out / f"rl_seed{i}" / "config.yaml").read_text())["loop"]["seed"] for i in range(2)]
    assert seeds == [0, 1] and len(res["runs"]) == 2 and all(len(r["policy_versions"]) == 1 for r in runs)
    assert res["after"]["episodes"] == 4 and res["after"]["successes"] == sum(r["successes"] for r in runs)
    assert res["before"]["episodes"] == 2 and res["tasks"] == 2
    lo, hi = res["interval_runs_and_tasks"]
    assert lo <= res["change"] <= hi and "runs, then games" in (out / "pooled.md").read_text()
    stamp = (out / "rl_seed0" / "eval.jsonl").stat().st_mtime
    assert mod.main(["run", "--smoke", "--out", str(out)]) == 0  # nothing to run again
    assert (out / "rl_seed0" / "eval.jsonl").stat().st_mtime == stamp
