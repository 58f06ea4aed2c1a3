"""``agentenv rollout --model MODULE:CALLABLE``: the user's own solver (OpenAI chat messages -> the next assistant
message) as a policy, on the README's shop env. It writes trajectories and, with ``--demos``, demo lines that
``agentenv sft --env`` plays back into the same episodes and trains on; a bad ``MODULE:CALLABLE`` is one error line
before any file is written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agentenv.cli import main
from agentenv.core.trajectory import read_jsonl
from agentenv.run.env_demos import env_demos
from agentenv.samplers.tiny import qwen_tokenizer

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README.split("## Writing a new tool environment", 1)[1].split("\n## ", 1)[0]
SHOP_ENV = next(b for b in re.findall(r"```python\n(.*?)```", SECTION, re.S) if b.startswith("# shop_env.py"))

SOLVERS = '''
import json
import re


def solve(messages):
    """Both lookups in one turn, then the product: structured tool calls, as an OpenAI server returns them."""
    if messages[-1]["role"] == "user":
        item = re.search(r"every (\\w+) in stock", messages[-1]["content"]).group(1)
        return {"role": "assistant", "content": "Looking it up.", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "lookup", "arguments": {"item": item}}},
            {"id": "b", "type": "function", "function": {"name": "lookup",
                                                         "arguments": json.dumps({"item": item, "field": "stock"})}}]}
    price, stock = (float(m["content"]) for m in messages[-2:])
    assert [m["role"] for m in messages[-2:]] == ["tool", "tool"]
    return {"content": f"{stock:g} x {price:g}: \\\\boxed{{{round(price * stock, 2):g}}}"}


def sloppy(messages):
    """Plain strings: first a broken call block (the env answers with an error, which reaches the solver as a user
    turn: it answers no call), then a wrong answer."""
    if len(messages) == 2:
        return '<tool_call>{"name": "lookup", "arguments": </tool_call>'
    return "\\\\boxed{0}"


def crash_late(messages):
    if messages[-1]["role"] == "user":
        return solve(messages)
    return {}["no such key"]


def not_a_message(messages):
    return 42


def crash(messages):
    return messages[99]


NOT_CALLABLE = {"content": "hi"}
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "shop_env.py").write_text(SHOP_ENV)
    (tmp_path / "solvers.py").write_text(SOLVERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "solvers", raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def lines(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_a_scripted_solver_writes_trajectories_and_demos_that_sft_plays_back_and_trains_on(user_dir, capsys, tok):
    assert main(["rollout", "--env", "shop_env:Shop-v0", "--model", "solvers:solve", "--episodes", "5",
                 "--out", "r.jsonl", "--demos", "d.jsonl"]) == 0
    out = capsys.readouterr().out
    assert "episodes=5 success=1.000" in out and "tool_call_rate=1.00" in out and "demos=5 (skipped 0)" in out, out
    trajs = read_jsonl("r.jsonl")
    assert all(t.success and t.tool_calls_by_name == {"lookup": 2} and t.model == "solvers:solve" for t in trajs)
    assert all(t.sampling["backend"] == "text" and not t.token_ids for t in trajs)
    demos = sorted(lines("d.jsonl"), key=lambda d: (d["task_index"], json.dumps(d)))
    assert [d["task_index"] for d in demos] == [0, 0, 1, 1, 2]  # the env's 3 tasks, dealt in order
    apple = demos[0]["messages"]
    assert [m["role"] for m in apple] == ["user", "assistant", "tool", "tool", "assistant"]
    assert apple[0]["content"] == "What would it cost, in euros, to buy every apple in stock?"
    assert apple[1]["content"] == "Looking it up."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in apple[1]["tool_calls"]] == \
        [("lookup", {"item": "apple"}), ("lookup", {"item": "apple", "field": "stock"})]
    assert [m["content"] for m in apple[2:]] == ["0.5", "120", "120 x 0.5: \\boxed{60}"]
    # played back by `agentenv sft --env`: the same episodes, turn for turn
    played = env_demos("shop_env:Shop-v0", "d.jsonl", tok)
    by_line = {t.meta["demo_line"]: t for t in played}
    assert len(played) == 5 and all(t.success and t.reward == 1.0 for t in played)
    raw = lines("d.jsonl")
    for k, t in by_line.items():
        live = next(x for x in trajs if x.messages[1]["content"] == raw[k - 1]["messages"][0]["content"])
        assert t.messages == live.messages and t.tool_calls_by_name == {"lookup": 2}
    assert main(["sft", "--env", "shop_env:Shop-v0", "--demos", "d.jsonl", "--model", "tiny-bpe:64x2", "--out", "m",
                 "--epochs", "1", "--batch-size", "5", "--heldout-demos", "0"]) == 0
    assert "sft demos=5 steps=1" in capsys.readouterr().out and (user_dir / "m" / "config.json").exists()


def test_plain_string_replies_and_broken_calls_make_faithful_demos(user_dir, capsys, tok):
    assert main(["rollout", "--env", "shop_env:Shop-v0", "--model", "solvers.py:sloppy", "--episodes", "3",
                 "--out", "r.jsonl", "--demos", "d.jsonl"]) == 0
    assert "success=0.000" in capsys.readouterr().out
    trajs = read_jsonl("r.jsonl")
    assert all(t.num_tool_malformed == 1 and t.num_turns == 2 for t in trajs)
    demo = lines("d.jsonl")[0]["messages"]  # the error result answers no call: left out, the env's own is played
    assert [m["role"] for m in demo] == ["user", "assistant", "assistant"]
    assert demo[1]["content"] == '<tool_call>{"name": "lookup", "arguments": </tool_call>' and "tool_calls" not in demo[1]
    with pytest.raises(Exception, match="no demo to train on"):  # failures are dropped unless --all ...
        env_demos("shop_env:Shop-v0", "d.jsonl", tok)
    played = env_demos("shop_env:Shop-v0", "d.jsonl", tok, only_successful=False)
    live = {t.messages[1]["content"]: t for t in trajs}
    assert [t.messages for t in played] == [live[t.messages[1]["content"]].messages for t in played]


def test_a_solver_that_raises_mid_episode_is_reported_and_left_out_of_the_demos(user_dir, capsys):
    assert main(["rollout", "--env", "shop_env:Shop-v0", "--model", "solvers:crash_late", "--episodes", "2",
                 "--out", "r.jsonl", "--demos", "d.jsonl"]) == 0
    cap = capsys.readouterr()
    assert "errors=2" in cap.out and "demos=0 (skipped 2)" in cap.out
    assert "warning: 2 episodes ended in policy_error; the first: KeyError: 'no such key'" in cap.err
    assert Path("d.jsonl").read_text() == ""


@pytest.mark.parametrize("model, must_say", [
    ("nosuch:solve", ["cannot import 'nosuch'", "run from the directory that holds nosuch.py, or give its path"]),
    ("no/such.py:solve", ["no such file 'no/such.py'"]),
    ("solvers:solv", ["solvers has no attribute 'solv'", "crash, crash_late, not_a_message, sloppy, solve"]),
    ("solvers:NOT_CALLABLE", ["solvers.NOT_CALLABLE is a dict, not callable", "name a function"]),
    ("solvers:not_a_message", ["solvers:not_a_message returned an int 42", "return the next assistant message"]),
    ("solvers:crash", ["solvers:crash raised IndexError: list index out of range at solvers.py:", "first prompt"]),
])
def test_a_bad_module_callable_is_one_error_line_and_writes_nothing(user_dir, capsys, model, must_say):
    assert main(["rollout", "--env", "shop_env:Shop-v0", "--model", model, "--out", "r.jsonl",
                 "--demos", "d.jsonl"]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    for s in must_say:
        assert s in err[0], (s, err[0])
    assert not (user_dir / "r.jsonl").exists() and not (user_dir / "d.jsonl").exists()
