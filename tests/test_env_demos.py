"""Chat-format demos for any env (``agentenv sft --env MODULE:ENV_ID --demos FILE.jsonl``), on the README's shop env.

A rendered demo must be token for token the episode the runtime builds when a policy writes the same turns live
(the real Qwen2.5 tokenizer and chat template, the real env and its tools); a demo that does not match the env is
one error line naming the file, line and field; the CLI trains from a file of them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gymnasium as gym
import pytest

from agentenv.cli import main
from agentenv.run.env_demos import DemoError, env_demos
from agentenv.core.policy import Generation
from agentenv.core.runtime import RolloutConfig, EpisodeSpec, run_episodes
from agentenv.samplers.tiny import qwen_tokenizer

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README.split("## Writing a new tool environment", 1)[1].split("\n## ", 1)[0]
SHOP_ENV = next(b for b in re.findall(r"```python\n(.*?)```", SECTION, re.S) if b.startswith("# shop_env.py"))
ITEMS = [("apple", "0.5", "120", "60"), ("bread", "2.25", "14", "31.5"), ("cheese", "7.8", "3", "23.4")]


def question(item: str) -> str:
    return f"What would it cost, in euros, to buy every {item} in stock?"


def demo(k: int) -> dict:
    item, price, stock, answer = ITEMS[k]
    return {"task_index": k, "messages": [
        {"role": "user", "content": question(item)},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"item": item}}},
            {"type": "function", "function": {"name": "lookup",
                                              "arguments": json.dumps({"item": item, "field": "stock"})}}]},
        {"role": "tool", "content": price},
        {"role": "tool", "content": stock},
        {"role": "assistant", "content": f"{stock} x {price}: \\boxed{{{answer}}}"}]}


def live_turns(k: int) -> list[str]:
    """What a model writes in the same episode: the two calls as Hermes blocks, then the answer."""
    item, price, stock, answer = ITEMS[k]
    return [f'<tool_call>\n{{"name": "lookup", "arguments": {{"item": "{item}"}}}}\n</tool_call>\n'
            f'<tool_call>\n{{"name": "lookup", "arguments": {{"item": "{item}", "field": "stock"}}}}\n</tool_call>',
            f"{stock} x {price}: \\boxed{{{answer}}}"]


class Writer:
    """A token-level policy writing fixed turns, by task (the episode's first prompt says which)."""

    name, model_path, policy_version, backend = "writer", None, 0, "scripted"

    def __init__(self, tok):
        self.tokenizer = tok
        self.turns: dict[str, list[str]] = {question(item): live_turns(k) for k, (item, *_) in enumerate(ITEMS)}

    def generate(self, requests):
        out = []
        for r in requests:
            text = self.tokenizer.decode(r.prompt_ids)
            q = next(q for q in self.turns if q in text)
            turn = text.count("<|im_start|>assistant") - 1
            ids = self.tokenizer(self.turns[q][turn], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            out.append(Generation(ids, [0.0] * len(ids), "stop"))
        return out


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "shop_env.py").write_text(SHOP_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demos.jsonl").write_text("".join(json.dumps(demo(k)) + "\n" for k in range(3)))
    return tmp_path


@pytest.fixture(scope="module")
def tok():
    return qwen_tokenizer()


def test_a_rendered_demo_is_the_live_episode_token_for_token(user_dir, tok):
    rendered = env_demos("shop_env:Shop-v0", user_dir / "demos.jsonl", tok)
    assert [t.meta["task"] for t in rendered] == [0, 1, 2] and all(t.success and t.reward == 1.0 for t in rendered)
    live = run_episodes(lambda: gym.make("shop_env:Shop-v0"), Writer(tok), 3, RolloutConfig(concurrency=3),
                        tasks=[EpisodeSpec(options={"task_index": k}, meta={"task": k}) for k in range(3)])
    live.sort(key=lambda t: t.meta["task"])
    env = gym.make("shop_env:Shop-v0")
    for k, (r, t) in enumerate(zip(rendered, live)):
        assert r.token_ids == t.token_ids and r.action_mask == t.action_mask, k
        assert r.messages == t.messages and r.tool_calls_by_name == t.tool_calls_by_name == {"lookup": 2}
        r.validate()
        # the prompt is the env's system prompt, question and tool schemas through the model's own chat template
        obs, info = env.reset(options={"task_index": k})
        prompt = tok.apply_chat_template([{"role": "system", "content": info["system"]}, {"role": "user", "content": obs}],
                                         tools=info["tools"], add_generation_prompt=True, tokenize=False)
        first = r.action_mask.index(True)
        assert r.token_ids[:first] == tok(prompt, add_special_tokens=False)["input_ids"]
        # the tool results between the turns are the env's, not copied from the demo
        sampled = tok.decode([i for i, m in zip(r.token_ids, r.action_mask) if m])
        assert sampled == "".join(x + "<|im_end|>" for x in live_turns(k))


def write(user_dir: Path, *demos) -> Path:
    path = user_dir / "bad.jsonl"
    path.write_text("".join((d if isinstance(d, str) else json.dumps(d)) + "\n" for d in demos))
    return path


def bad(field_path: list, value, k: int = 0) -> dict:
    d = demo(k)
    target = d
    for key in field_path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[field_path[-1]]
    else:
        target[field_path[-1]] = value
    return d


@pytest.mark.parametrize("broken, where", [
    (bad(["messages", 0, "content"], question("bread")), "messages[0].content: the env's question for task_index 0"),
    (bad(["messages", 1, "tool_calls", 1, "function", "name"], "lokup"),
     "messages[1].tool_calls[1].function.name: unknown tool 'lokup'; the env's tools: lookup"),
    (bad(["messages", 1, "tool_calls", 0, "function", "arguments"], "[1]"),
     "messages[1].tool_calls[0].function.arguments: not a JSON object"),
    (bad(["messages", 3, "content"], "121"), "messages[2]: the env answered tool '[1] lookup:\\n0.5\\n\\n[2] lookup:\\n120'"),
    (bad(["task_index"], 7), "task_index: 7 is not a task index of this env (0..2)"),
    ({"task_index": 0, "messages": [{"role": "system", "content": "s"}] + demo(0)["messages"]},
     "messages[0].role: 'system' is not user, assistant or tool; the env supplies its own system prompt"),
    ({"task_index": 0, "messages": demo(0)["messages"] + [{"role": "user", "content": "more?"},
                                                          {"role": "assistant", "content": "no"}]},
     "messages[5]: the env ended the episode after messages[4] (finish_reason done)"),
    ("{not json", "not JSON"),
])
def test_a_demo_that_does_not_match_the_env_is_one_error_naming_file_line_and_field(user_dir, tok, broken, where):
    path = write(user_dir, demo(1), broken)
    with pytest.raises(DemoError) as e:
        env_demos("shop_env:Shop-v0", path, tok)
    assert str(e.value).startswith(f"{path}:2: ") and where in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_sft_from_the_cli_on_chat_demos(user_dir, capsys):
    path = write(user_dir, bad(["messages", 1, "tool_calls", 0, "function", "name"], "price"))
    assert main(["sft", "--env", "shop_env:Shop-v0", "--demos", str(path), "--model", "tiny-bpe", "--out", "m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' weight-loading bar
    assert err.startswith(f"error: {path}:1: messages[1].tool_calls[0].function.name: unknown tool 'price'"), err
    assert not (user_dir / "m").exists()
    assert main(["sft", "--env", "shop_env:Shop-v0", "--demos", "demos.jsonl", "--model", "tiny-bpe", "--out", "m",
                 "--epochs", "2", "--batch-size", "3"]) == 0
    assert "sft demos=3 steps=2" in capsys.readouterr().out
    assert (user_dir / "m" / "config.json").exists()


def test_sft_uses_every_demo_of_a_file_unless_told_and_says_when_it_cuts(user_dir, capsys):
    """A file's demos are all used by default (a silent cap of 1,000 once hid 600 of a user's 1,600); --num-demos N
    keeps the first N and says so."""
    (user_dir / "demos.jsonl").write_text("".join(json.dumps(demo(k % 3)) + "\n" for k in range(1005)))
    args = ["sft", "--env", "shop_env:Shop-v0", "--demos", "demos.jsonl", "--model", "tiny-bpe", "--epochs", "1",
            "--batch-size", "1024", "--heldout-demos", "0"]
    assert main([*args, "--out", "all"]) == 0
    out = capsys.readouterr().out
    assert "sft demos=1005 " in out and "using the first" not in out
    assert main([*args, "--out", "some", "--num-demos", "4"]) == 0
    out = capsys.readouterr().out
    assert "sft: using the first 4 of the 1005 demos in demos.jsonl (--num-demos 4)" in out and "sft demos=4 " in out
