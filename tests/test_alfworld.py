"""ALFWorld env tests on real games: the shared json_2.1.1 archive (unpacked once to a cache dir) and the sample
shipped in the package. Tests needing the archive skip, with the reason, when it is absent."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("alfworld", reason="alfworld is not installed (pip install 'agentenv[alfworld]')")

from agentenv.envs.alfworld import (
    SAMPLE_DIR,
    TASK_TYPES,
    ALFWorldDataError,
    ALFWorldEnv,
    list_games,
    parse_action,
)
from agentenv.envs.alfworld_expert import ALFWorldExpert
from gymnasium.utils import seeding
from gymnasium.utils.env_checker import check_env

from agentenv.core.cache import atomic_dir
from agentenv.core.runtime import EpisodeSpec, RolloutConfig, run_episode

pytestmark = pytest.mark.alfworld

REPO = Path(__file__).resolve().parents[1]
ARCHIVE = REPO.parent / "shared" / "data" / "alfworld" / "alfworld-json_2.1.1.tar.xz"
CACHE = Path(os.environ.get("AGENTENV_ALFWORLD_CACHE", Path.home() / ".cache" / "agentenv" / "alfworld-json_2.1.1"))

# Fixed real games (from valid_unseen) reused across tests: a game loaded once is cheap to reset again.
PICK_PLACE = "json_2.1.1/valid_unseen/pick_and_place_simple-Mug-None-Desk-308/trial_T20190909_210238_431966/game.tw-pddl"


def unpack_archive() -> Path:
    """The archive unpacked under CACHE once, through the cache's one rename (:func:`atomic_dir`): concurrent test
    processes, and the ALFWorld study unpacking into the same directory, end with one copy."""
    if not CACHE.exists() and not ARCHIVE.is_file():
        pytest.skip(f"ALFWorld archive not found at {ARCHIVE} (the shared data folder next to the repo)")

    def unpack(out: Path) -> None:
        if shutil.which("tar"):  # several times faster than tarfile's xz
            subprocess.run(["tar", "-xJf", str(ARCHIVE), "-C", str(out)], check=True)
        else:
            with tarfile.open(ARCHIVE) as tar:
                tar.extractall(out, filter="data")

    return atomic_dir(CACHE, unpack)


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return unpack_archive()


@pytest.fixture(scope="module")
def env(data_dir):
    env = ALFWorldEnv("valid_unseen", data_dir, expert=True)
    yield env
    env.close()


# --------------------------------------------------------------------------------------------------- data location
def test_splits_from_archive(data_dir):
    assert len(list_games("valid_seen", data_dir)) == 140
    assert len(list_games("unseen", data_dir)) == 134
    assert list_games("seen", data_dir) == list_games("valid_seen", data_dir)
    assert PICK_PLACE in list_games("valid_unseen", data_dir)
    by_type = list_games("valid_unseen", data_dir, task_types=["pick_two_obj_and_place"])
    assert by_type and all("pick_two_obj_and_place" in g for g in by_type)


def test_data_dir_from_environment_variable(data_dir, monkeypatch):
    monkeypatch.setenv("ALFWORLD_DATA", str(data_dir))
    assert len(ALFWorldEnv("valid_seen").games) == 140


@pytest.mark.skipif((Path.home() / ".cache" / "alfworld" / "json_2.1.1").is_dir(),
                    reason="alfworld-download's games in ~/.cache/alfworld come before the shipped sample")
def test_packaged_sample_loads_without_alfworld_data(monkeypatch):
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    env = ALFWorldEnv("valid_seen")
    assert env.data_root == SAMPLE_DIR
    assert len(env.games) == 6 and len(list_games("train")) == 12 and len(list_games("valid_unseen")) == 6
    assert {g.split("/")[2].split("-")[0] for g in env.games} == set(TASK_TYPES)  # one game per task type
    obs, info = env.reset(seed=0)
    assert "Your task is to:" in obs and info["task"] in env.games
    env.close()


def test_preflight_calls_only_a_sample_a_sample(data_dir):
    """The full release filtered to two task types is every game of those types, not a sample to warn about; the
    shipped demo games are a sample (the two types only), and the check says how to get the rest."""
    types = ["pick_and_place", "look_at_obj_in_light"]
    full = {c.what: c for c in ALFWorldEnv.preflight(splits=["train", "valid_seen"], data_dir=data_dir, task_types=types)}
    assert full["alfworld train"].ok and full["alfworld train"].detail.startswith("1098 games under")
    assert "full split" not in full["alfworld train"].detail and "full split" not in full["alfworld valid_seen"].detail
    demo = {c.what: c for c in ALFWorldEnv.preflight(splits=["valid_seen"], data_dir="builtin:demo", task_types=types)}
    assert "48 games" in demo["alfworld valid_seen"].detail and "the full split has 140" in demo["alfworld valid_seen"].detail


def test_dev_split_is_a_stable_part_of_train_that_rl_never_draws(tmp_path):
    """dev_games=N: split dev is N shipped train games chosen by path hash, train the rest; the RL task pool of the
    ALFWorld demo preset with it holds no dev game, and the choice does not depend on file order."""
    from agentenv.core.config import load_config
    from agentenv.envs.alfworld_data import dev_and_train
    from agentenv.run.episodes import task_list

    types = ["pick_and_place", "look_at_obj_in_light"]
    everything = list_games("train", "builtin:demo", types)
    dev = list_games("dev", "builtin:demo", types, dev_games=16)
    train = list_games("train", "builtin:demo", types, dev_games=16)
    assert len(dev) == 16 and len(train) == len(everything) - 16
    assert not set(dev) & set(train) and sorted(dev + train) == everything
    assert dev_and_train(everything[::-1], 16) == (dev, train)  # a fixed choice, whatever the order
    assert set(dev) < set(list_games("dev", "builtin:demo", types, dev_games=17))  # one more keeps the first 16
    cfg = load_config("alfworld_demo", [], ["env.kwargs.dev_games=16", f"run.dir={tmp_path}"])
    env = ALFWorldEnv("train", "builtin:demo", task_types=types, dev_games=16)
    pool = {env.games[t.options["game"]] for t in task_list(cfg)}
    assert pool == set(train) and not pool & set(dev)
    assert ALFWorldEnv("dev", "builtin:demo", task_types=types, dev_games=16).games == dev
    with pytest.raises(ValueError, match="dev_games=N"):
        ALFWorldEnv("dev", "builtin:demo", task_types=types)


def test_empty_alfworld_data_means_unset():
    """alfworld itself crashes at import on ALFWORLD_DATA="" (os.makedirs('')); the env treats it as unset. A fresh
    process, because alfworld reads the variable once, at its first import."""
    code = ("from agentenv.envs.alfworld import ALFWorldEnv; e = ALFWorldEnv('valid_seen', 'builtin:sample'); "
            "obs, info = e.reset(seed=0); print('Your task is to:' in obs)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ALFWORLD_DATA": ""}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr[-2000:]


def test_missing_data_says_how_to_get_it(tmp_path, monkeypatch):
    with pytest.raises(ALFWorldDataError, match="alfworld-download") as e:
        ALFWorldEnv("valid_seen", tmp_path)
    assert "tar -xJf alfworld-json_2.1.1.tar.xz" in str(e.value) and "ALFWORLD_DATA" in str(e.value)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(ALFWorldDataError, match="nowhere"):
        ALFWorldEnv("valid_seen")
    (tmp_path / "json_2.1.1" / "valid_seen").mkdir(parents=True)
    with pytest.raises(ALFWorldDataError, match="No ALFWorld games for split 'train'"):
        ALFWorldEnv("train", tmp_path)
    with pytest.raises(ValueError, match="unknown ALFWorld split"):
        ALFWorldEnv("test", tmp_path)


# ------------------------------------------------------------------------------------------------ actions & limits
def test_parse_action():
    assert parse_action("<action>go to desk 1</action>") == "go to desk 1"
    assert parse_action("I should look first.\n<action>  Go  To\nDesk 1. </action> trailing") == "go to desk 1"
    assert parse_action("<action>look</action> no wait <ACTION>inventory</ACTION>") == "inventory"
    assert parse_action("go to desk 1") is None
    assert parse_action("<action> </action>") is None
    assert parse_action("<action>go to desk 1") is None


def test_reset_observation_and_info(env):
    obs, info = env.reset(options={"game": PICK_PLACE})
    assert obs.startswith("You are in the middle of a room") and "Welcome to TextWorld" not in obs
    assert "\n\nYour task is to: put a mug in desk.\n\n" in obs
    assert obs.endswith("Admissible actions:\n" + "\n".join(info["admissible_commands"]))
    assert info["task"] == PICK_PLACE and info["task_type"] == "pick_and_place" and info["split"] == "valid_unseen"
    assert info["role"] == "user" and "<action>" in info["system"] and "50 turns" in info["system"]
    assert info["turn"] == 0 and info["invalid_actions"] == 0 and info["success"] is False
    assert env.observation_space.contains(obs)


def test_unparseable_and_inadmissible_actions_cost_a_turn(env):
    _, info0 = env.reset(options={"game": PICK_PLACE})
    obs, reward, term, trunc, info = env.step("go to desk 1")  # no tag
    assert info["invalid_action"] and "no <action>...</action> tag" in obs
    assert (reward, term, trunc) == (0.0, False, False)
    assert info["turn"] == 1 and info["invalid_actions"] == 1
    assert info["admissible_commands"] == info0["admissible_commands"]  # nothing happened in the game
    obs, _, _, _, info = env.step("<action>fly to the moon</action>")
    assert info["invalid_action"] and '"fly to the moon" is not one of the admissible actions' in obs
    assert obs.endswith("\n".join(info0["admissible_commands"]))
    assert info["turn"] == 2 and info["invalid_actions"] == 2
    obs, _, _, _, info = env.step("Thinking... <action>Go to desk 2</action>")
    assert not info["invalid_action"] and obs.startswith("You arrive at desk 2")
    assert info["turn"] == 3 and info["invalid_actions"] == 2


def test_invalid_action_budget_ends_the_episode(data_dir):
    env = ALFWorldEnv("valid_unseen", data_dir, invalid_action_budget=2)
    env.reset(options={"game": PICK_PLACE})
    _, _, term, trunc, info = env.step("<action>look</action>")
    assert not term and not info["invalid_action"]
    _, _, term, _, info = env.step("nonsense")
    assert not term
    obs, reward, term, trunc, info = env.step("<action>dance</action>")
    assert term and not trunc and reward == 0.0
    assert info["finish_reason"] == "invalid_action_budget" and info["success"] is False
    assert "invalid action 2 of 2" in obs
    with pytest.raises(RuntimeError, match="call reset"):
        env.step("<action>look</action>")
    env.close()


def test_turn_limit_truncates_and_is_never_success(data_dir):
    env = ALFWorldEnv("valid_unseen", data_dir, max_turns=3, expert=True)
    _, info = env.reset(options={"game": PICK_PLACE})
    assert "3 turns" in info["system"]
    for turn in (1, 2):
        _, _, term, trunc, info = env.step(ALFWorldExpert().act([], info))
        assert not term and not trunc
    obs, reward, term, trunc, info = env.step("<action>look</action>")
    assert trunc and not term and reward == 0.0
    assert info["finish_reason"] == "max_turns" and info["success"] is False and "last of 3 turns" in obs
    # Winning on the last allowed turn is a win, not a truncation.
    walkthrough_len = 4
    env = ALFWorldEnv("valid_unseen", data_dir, max_turns=walkthrough_len, expert=True)
    _, info = env.reset(options={"game": PICK_PLACE})
    for _ in range(walkthrough_len):
        obs, reward, term, trunc, info = env.step(ALFWorldExpert().act([], info))
    assert term and not trunc and reward == 1.0 and info["success"] and info["finish_reason"] == "done"


# --------------------------------------------------------------------------------------------------------- expert
def test_expert_wins_through_the_runtime(data_dir):
    env = ALFWorldEnv("valid_unseen", data_dir, **ALFWorldExpert.env_kwargs)
    traj = run_episode(env, ALFWorldExpert(), RolloutConfig(max_turns=60), EpisodeSpec(options={"game": PICK_PLACE}))
    env.close()
    assert traj.success and traj.reward == 1.0 and traj.terminated and not traj.truncated, traj.error
    assert traj.finish_reason == "done" and traj.num_invalid_actions == 0 and traj.num_turns == 4
    assert traj.task == PICK_PLACE and traj.task_type == "pick_and_place" and traj.model == "expert"
    assert traj.messages[0]["role"] == "system" and traj.messages[-1]["content"].startswith("You move the mug 1")


def test_expert_replans_after_the_episode_leaves_the_walkthrough(env):
    _, info = env.reset(options={"game": PICK_PLACE})
    first = info["expert_action"]
    _, _, _, _, info = env.step("<action>look</action>")  # changes nothing: the walkthrough still holds
    assert info["expert_action"] == first
    detour = next(c for c in info["admissible_commands"] if c.startswith("go to") and c != first)
    _, _, _, _, info = env.step(f"<action>{detour}</action>")
    done = False
    while not done:
        _, reward, term, trunc, info = env.step(ALFWorldExpert().act([], info))
        done = term or trunc
    assert info["success"] and reward == 1.0


def test_expert_needs_an_expert_env(data_dir):
    env = ALFWorldEnv("valid_unseen", data_dir)
    _, info = env.reset(options={"game": PICK_PLACE})
    assert "expert_action" not in info
    with pytest.raises(ValueError, match="expert=True"):
        ALFWorldExpert().act([], info)


# ------------------------------------------------------------------------------------------------ game selection
def test_seeded_game_selection_is_reproducible(data_dir):
    # One task type (small bedroom scenes) keeps the resets cheap; selection works the same on any game list.
    a, b = (ALFWorldEnv("valid_seen", data_dir, task_types=["look_at_obj_in_light"]) for _ in range(2))
    obs_a, info_a = a.reset(seed=7)
    obs_b, info_b = b.reset(seed=7)
    assert (obs_a, info_a["task"]) == (obs_b, info_b["task"])
    assert a.reset()[1]["task"] == b.reset()[1]["task"]  # the unseeded draw continues the seeded stream
    # The game is the first draw of the seeded np_random: different seeds spread over the split.
    expected = [a.games[seeding.np_random(s)[0].integers(len(a.games))] for s in range(10)]
    assert len(set(expected)) > 3 and a.reset(seed=7)[1]["task"] == expected[7]
    by_index = a.reset(options={"game": 3})[1]["task"]
    assert by_index == a.games[3]
    assert a.reset(options={"game": str(data_dir / Path(by_index).parent)})[1]["task"] == by_index
    with pytest.raises(IndexError, match=f"{len(a.games)} games"):
        a.reset(options={"game": len(a.games)})
    a.close()
    b.close()


def _alfworld(data_dir, *overrides):
    """The alfworld preset on these games: the common evaluation and task list read it as a run would."""
    from agentenv.core.config import load_config

    return load_config("alfworld", [], [f"env.kwargs.data_dir={data_dir}", *overrides])


def test_evaluation_order_covers_every_game_k_times(data_dir):
    from agentenv.run.episodes import task_list

    tasks = task_list(_alfworld(data_dir), "valid_unseen", samples=2)
    assert len(tasks) == 268
    assert [(t.options["game"], t.meta["sample"]) for t in tasks[:3]] == [(0, 0), (0, 1), (1, 0)]


def test_expert_wins_every_sample_game_through_the_common_evaluation():
    # The shipped sample has one valid_unseen game per task type, all six in flight on threads: textworld's parsers
    # are not thread-safe, and the env must serialize them (unserialized, episodes fail with parse errors). The
    # expert's env_kwargs (expert=True) reach the envs through EpisodeSet.for_policy.
    from agentenv.run.evaluation import evaluate

    m = evaluate(_alfworld(SAMPLE_DIR, "eval.samples=1"), ALFWorldExpert(), "unseen", progress=False)
    assert (m["episodes"], m["successes"], m["success_rate"]) == (6, 6, 1.0)
    assert m["episodes_by_type"] == {t: 1 for t in sorted(TASK_TYPES.values())}
    assert all(m[f"success_{t}"] == 1.0 for t in TASK_TYPES.values())


def test_check_env():
    # On the shipped sample's games: check_env resets several random games, and these are the cheapest real ones.
    env = ALFWorldEnv("valid_seen", SAMPLE_DIR, expert=True, render_mode="ansi")
    check_env(env, skip_render_check=True)
    obs, _ = env.reset(seed=0)
    assert env.render() == obs
    env.close()


# ---------------------------------------------------------------------------------------------- full expert eval
@pytest.mark.slow
def test_expert_wins_every_seen_and_unseen_game(data_dir):
    from agentenv.run.evaluation import evaluate

    for split, n in (("valid_seen", 140), ("valid_unseen", 134)):
        m = evaluate(_alfworld(data_dir, "eval.samples=1"), ALFWorldExpert(), split, progress=False)
        lost = [game for game, (won, played) in m["task_successes"].items() if won < played]
        assert m["successes"] == m["episodes"] == n and not lost, lost


# ------------------------------------------------------------------------------------------------ the searcher
def _play_searcher(env, game, searcher):
    obs, info = env.reset(options={"game": game})
    messages = [{"role": "system", "content": info["system"]}, {"role": "user", "content": obs}]
    done, actions = False, []
    while not done:
        reply = searcher.act(messages, info)
        obs, reward, term, trunc, info = env.step(reply)
        assert not info["invalid_action"], (reply, obs)
        actions.append(reply)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": obs}]
        done = term or trunc
    return actions, info


def test_searcher_wins_from_what_the_agent_sees(data_dir):
    import importlib.util

    spec = importlib.util.spec_from_file_location("alfworld_searcher", REPO / "scripts" / "alfworld_searcher.py")
    searcher = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(searcher)
    ALFWorldSearcher, parse_goal = searcher.ALFWorldSearcher, searcher.parse_goal

    assert ALFWorldSearcher.env_kwargs == {}
    env = ALFWorldEnv("valid_unseen", data_dir, max_turns=60, task_types=["pick_and_place", "look_at_obj_in_light"])
    picks = [g for g in env.games if "pick_and_place_simple" in g][:3]
    looks = [g for g in env.games if "look_at_obj_in_light" in g][:3]
    plays = {}
    for game in picks + looks:
        actions, info = _play_searcher(env, game, ALFWorldSearcher(seed=0))
        assert info["success"] and info["invalid_actions"] == 0, (game, actions)
        plays[game] = actions
        # It delivers with the goal's own verbs: a move onto the target kind, or using the lamp it found.
        last = actions[-1]
        assert last.startswith("<action>move ") if game in picks else last.startswith("<action>use ")
    # Stateless and seeded: the same (game, seed) replays exactly; another seed searches in another order somewhere.
    assert _play_searcher(env, picks[0], ALFWorldSearcher(seed=0))[0] == plays[picks[0]]
    assert any(_play_searcher(env, g, ALFWorldSearcher(seed=1))[0] != plays[g] for g in picks + looks)
    env.close()
    assert parse_goal("Your task is to: put some mug on desk.") == ("pick_and_place", "mug", "desk")
    assert parse_goal("Your task is to: examine the book with the desklamp.") == ("look_at_obj_in_light", "book", "desklamp")
    with pytest.raises(ValueError, match="pick_and_place and look_at_obj_in_light goals only"):
        parse_goal("Your task is to: heat some egg and put it in garbagecan.")


def test_nearest_match_plays_the_closest_admissible_command_and_says_so(data_dir):
    from agentenv.envs.alfworld import nearest_command

    env = ALFWorldEnv("valid_unseen", data_dir, nearest_match=True, invalid_action_budget=2)
    obs, info = env.reset(options={"game": PICK_PLACE})
    assert "read as the listed action closest to it in spelling that does the same to the same object" in info["system"]
    assert info["approximate_actions"] == 0
    # "desk 3" does not exist in this room; the closest listed command is a real one, and the agent is told which.
    obs, _, _, _, info = env.step("<action>go to desk 3</action>")
    assert obs.startswith('(Read as "go to desk ') and "You arrive at desk " in obs
    assert info["approximate_action"] and not info["invalid_action"] and info["approximate_actions"] == 1
    # An exact command is played as written; a reply without a tag is still invalid and still spends the budget.
    exact = next(c for c in info["admissible_commands"] if c.startswith("go to "))
    obs, _, _, _, info = env.step(f"<action>{exact}</action>")
    assert obs.startswith(f"You arrive at {exact[len('go to '):]}") and not info["approximate_action"]
    _, _, term, _, info = env.step("I am lost")
    assert info["invalid_action"] and not term and info["invalid_actions"] == 1
    # Taking an object that is not at hand is invalid (and spends the budget), not a take of whatever is there.
    obs, _, term, _, info = env.step("<action>take spatula 1 from desk 1</action>")
    assert info["invalid_action"] and not info["approximate_action"] and term and info["invalid_actions"] == 2
    assert 'none of them is "take spatula ..."' in obs
    env.close()
    commands = ["help", "take alarmclock 2 from shelf 1", "take creditcard 3 from shelf 1", "go to shelf 2"]
    assert nearest_command("take alarmclock 4 from sidetable 1", commands) == "take alarmclock 2 from shelf 1"
    assert nearest_command("help me", ["help"]) is None  # help is never chosen: it changes nothing
    # The object acted on is never swapped: a take of an object that is not at hand has no nearest command, though a
    # take of the creditcard here is closer to it in spelling than anything else.
    assert nearest_command("take creditcard 3 from shelf 2", commands) == "take creditcard 3 from shelf 1"
    assert nearest_command("take cellphone 3 from shelf 1", commands) is None
    assert nearest_command("go to desk 1", commands) is None and nearest_command("go to shelf 1", commands) == "go to shelf 2"


def test_restate_goal_repeats_the_task_line_before_every_later_list(data_dir):
    plain = ALFWorldEnv("valid_unseen", data_dir, max_turns=3)
    env = ALFWorldEnv("valid_unseen", data_dir, max_turns=3, restate_goal=True)
    first_plain, _ = plain.reset(options={"game": PICK_PLACE})
    first, info = env.reset(options={"game": PICK_PLACE})
    assert first == first_plain  # the opening already states the goal once
    goal = next(line for line in first.splitlines() if line.startswith("Your task is to: "))
    move = next(c for c in info["admissible_commands"] if c.startswith("go to "))
    for reply in (f"<action>{move}</action>", "no tag here"):  # a valid and an invalid turn both restate it
        obs_plain, *_ = plain.step(f"<action>{move}</action>" if reply != "no tag here" else reply)
        obs, _, _, truncated, _ = env.step(reply)
        before, _, after = obs.partition(f"\n\n{goal}\n\nAdmissible actions:\n")
        assert after, obs
        assert f"{before}\n\nAdmissible actions:\n{after}" == obs_plain  # only the goal line was added
    obs, _, _, truncated, _ = env.step(f"<action>{move}</action>")
    assert truncated and goal not in obs  # the last observation has no list and no restated goal
    plain.close()
    env.close()


def test_compact_list_lists_only_what_changes_from_state_to_state(data_dir):
    from agentenv.envs.alfworld import ALWAYS_ADMISSIBLE, GO_TO_LINE

    full = ALFWorldEnv("valid_unseen", data_dir, max_turns=4, nearest_match=True)
    env = ALFWorldEnv("valid_unseen", data_dir, max_turns=4, nearest_match=True, compact_list=True)
    assert "go to any receptacle in the room" in env.system_prompt and "read as the closest" in env.system_prompt
    assert len(env.system_prompt) < len(full.system_prompt) / 1.4
    obs_full, info_full = full.reset(options={"game": PICK_PLACE})
    obs, info = env.reset(options={"game": PICK_PLACE})
    for turn in range(3):
        assert info["admissible_commands"] == info_full["admissible_commands"]  # the game admits exactly the same
        head, _, listed = obs.partition("\n\nAdmissible actions:\n")
        assert head == obs_full.partition("\n\nAdmissible actions:\n")[0]  # the game text is untouched
        lines = listed.split("\n")
        assert lines[0] == GO_TO_LINE
        assert lines[1:] == [c for c in info["admissible_commands"]
                             if not c.startswith("go to ") and c not in ALWAYS_ADMISSIBLE]
        # a command left out of the list is still played as it is written: go to, look
        command = ("go to desk 1", "look", next(c for c in info["admissible_commands"] if c.startswith("go to ")))[turn]
        assert command in info["admissible_commands"]
        obs_full, *_ , info_full = full.step(f"<action>{command}</action>")
        obs, _, _, _, info = env.step(f"<action>{command}</action>")
        assert not info["approximate_action"] and not info["invalid_action"]
    assert len(obs) < len(obs_full)
    full.close()
    env.close()


def test_parse_memos_leave_every_observation_unchanged(data_dir, tmp_path):
    """textworld's template and query parses are memoized, its text contexts copied shallowly and a game's logic
    built once (a step ~9x faster, a reset ~2x); a fresh process without them must see byte-identical observations
    over random walks of two envs through the same and different real games of every task type."""
    import json
    import sys

    script = tmp_path / "walk.py"
    script.write_text(f"""
import json, random, sys
import agentenv.envs.alfworld as alf
if sys.argv[1] == "off":
    alf._install_parse_memos = lambda: None
envs = [alf.ALFWorldEnv("valid_unseen", {str(data_dir)!r}, max_turns=30) for _ in range(2)]
rng, out = random.Random(0), []
games = list(range(0, len(envs[0].task_options()), 17))  # 8 games across the task types
# the two envs play neighbouring games side by side, so each game is played by both envs in turn: what one game's
# load shares must not leak into another game's play, nor into the other env's
for a, b in zip(games, games[1:] + games[:1]):
    resets = [env.reset(options={{"game": g}}) for env, g in zip(envs, (a, b))]
    out += [obs for obs, _ in resets]
    infos = [info for _, info in resets]
    for _ in range(8):
        for i, env in enumerate(envs):
            obs, _, term, trunc, infos[i] = env.step("<action>" + rng.choice(infos[i]["admissible_commands"]) + "</action>")
            out.append(obs)
            if term or trunc:
                infos[i] = env.reset(options={{"game": a}})[1]
print(json.dumps(out))
""")
    walks = [json.loads(subprocess.run([sys.executable, str(script), mode], check=True, capture_output=True,
                                       text=True).stdout.splitlines()[-1]) for mode in ("on", "off")]
    assert len(walks[0]) > 10 and walks[0] == walks[1]



def test_a_game_that_never_plans_is_translated_once(data_dir, tmp_path):
    """textworld translates each game twice, the second time "optimized" for its planner only. An env that asks for
    no plan skips that translation (half of a first load) and sees byte-identical observations to a process that runs
    both; the expert still gets the optimized translation, and its plan still wins the game."""
    import json
    import sys

    script = tmp_path / "walk.py"
    script.write_text(f"""
import json, random, sys
import fast_downward
calls, original = [], fast_downward.pddl2sas
def counting(domain, problem, verbose=False, optimize=False):
    calls.append(bool(optimize))
    return original(domain, problem, verbose=verbose, optimize=optimize)
fast_downward.pddl2sas = counting
import agentenv.envs.alfworld as alf
if sys.argv[1] == "plain":  # every load plans: textworld's own path
    class WritesIgnored(list):
        def __setitem__(self, i, v):
            return None  # the env's "this load will not plan" is dropped: the flag stays True
    alf._PLANS = WritesIgnored([True])
env = alf.ALFWorldEnv("valid_unseen", {str(data_dir)!r}, max_turns=30)
rng, out = random.Random(0), []
for game in (0, 5, 0):
    obs, info = env.reset(options={{"game": game}})
    out.append(obs)
    for _ in range(6):
        obs, _, term, trunc, info = env.step("<action>" + rng.choice(info["admissible_commands"]) + "</action>")
        out.append(obs)
player_calls = list(calls)
expert = alf.ALFWorldEnv("valid_unseen", {str(data_dir)!r}, max_turns=30, expert=True)
obs, info = expert.reset(options={{"game": 5}})
for _ in range(30):
    obs, reward, term, trunc, info = expert.step("<action>" + info["expert_action"] + "</action>")
    if term or trunc:
        break
print(json.dumps({{"out": out, "player_calls": player_calls, "expert_calls": calls[len(player_calls):],
                  "expert_won": bool(info["success"])}}))
""")
    skip, plain = (json.loads(subprocess.run([sys.executable, str(script), mode], check=True, capture_output=True,
                                             text=True).stdout.splitlines()[-1]) for mode in ("skip", "plain"))
    assert skip["player_calls"] == [False, False]  # two games, one translation each (game 0's reload is memoized)
    assert plain["player_calls"] == [False, True, False, True]
    assert len(skip["out"]) == 21 and skip["out"] == plain["out"]
    assert skip["expert_calls"] == [True] and skip["expert_won"]  # its game's plain translation was memoized
    assert plain["expert_calls"] == [] and plain["expert_won"]  # both of them were


def test_failure_modes_sort_real_episodes_by_what_happened_to_the_goal_object(data_dir):
    """scripts/alfworld_failure_modes.py on episodes played in a real game: one that picks up another object, one that
    picks up the goal's object and stops, and (old spelling-only matching, as its transcript reads) a swapped take."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("failure_modes", REPO / "scripts" / "alfworld_failure_modes.py")
    fm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fm)
    env = ALFWorldEnv("valid_unseen", data_dir, nearest_match=True, max_turns=30, invalid_action_budget=30)
    try:
        def play(want_goal: bool) -> list[dict]:
            obs, info = env.reset(options={"game": PICK_PLACE})  # "put some mug on desk"
            msgs = [{"role": "user", "content": obs}]
            for c in [c for c in info["admissible_commands"] if c.startswith("go to ")]:
                obs, _, _, _, info = env.step(f"<action>{c}</action>")
                msgs += [{"role": "assistant", "content": f"<action>{c}</action>"}, {"role": "user", "content": obs}]
                takes = [t for t in info["admissible_commands"] if t.startswith("take ")
                         and (t.split()[1] == "mug") == want_goal]
                if takes:
                    obs, _, _, _, info = env.step(f"<action>{takes[0]}</action>")
                    return msgs + [{"role": "assistant", "content": f"<action>{takes[0]}</action>"},
                                   {"role": "user", "content": obs}]
            raise AssertionError("no receptacle offered the take this test needs")

        other, goal = play(False), play(True)
    finally:
        env.close()
    assert fm.failure_mode(other, False) == ("took another object first", False)
    assert fm.failure_mode(goal, False) == ("took it, did not finish", False)
    assert fm.failure_mode(goal, True) == ("won", False)
    assert fm.failure_mode(other[:1], False)[0] in ("never saw it", "saw it, never took it")
    swapped = other[:-2] + [{"role": "assistant", "content": "<action>take mug 1 from desk 1</action>"},
                            {"role": "user", "content": '(Read as "x".) ' + other[-1]["content"]}]
    assert fm.failure_mode(swapped, False) == ("took another object first", True)
