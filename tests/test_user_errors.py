"""A user's mistakes, through the command line: each prints ONE ``error:`` line naming what is wrong and the fix,
exits non-zero, shows no traceback (that needs ``-v``) and leaves no run directory (or output file) behind.

The cases are the issue's list: a model directory without a tokenizer, a task row without an answer, a wrong env
argument (``--env-arg`` and ``env.kwargs``), a tool without a type hint, W&B asked for but not installed, a model path
that does not exist, and a hub model that is not downloaded. ``python -m agentenv.cli`` runs each, from a directory
holding the user's env module (the README's way)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

QA_ENV = '''
import gymnasium as gym

from agentenv.envs.tool_env import ToolEnv
from agentenv.envs.tools import tool


@tool
def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class QA(ToolEnv):
    def __init__(self, tasks: str = "tasks.jsonl", max_turns: int = 3, **kwargs):
        super().__init__(tasks, [add], max_turns=max_turns, **kwargs)


gym.register("QA-v0", entry_point=QA)
'''

NO_HINT_ENV = '''
import gymnasium as gym

from agentenv.envs.tool_env import ToolEnv
from agentenv.envs.tools import tool


@tool
def lookup(item) -> str:
    """Look an item up.

    Args:
        item: The item.
    """
    return item


gym.register("NoHint-v0", entry_point=lambda **kw: ToolEnv([{"question": "q", "answer": "a"}], [lookup], **kw))
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    from agentenv.samplers.models import resolve_model

    d = tmp_path_factory.mktemp("user")
    (d / "qa_env.py").write_text(textwrap.dedent(QA_ENV))
    (d / "no_hint_env.py").write_text(textwrap.dedent(NO_HINT_ENV))
    (d / "tasks.jsonl").write_text('{"question": "What is 2 + 3?", "answer": 5}\n')
    (d / "no_answer.jsonl").write_text('{"question": "What is 2 + 3?", "answer": 5}\n{"question": "What is 4 + 4?"}\n')
    weights = Path(resolve_model("tiny-bpe:64x2").path)
    (d / "no_tokenizer").mkdir()
    for f in weights.iterdir():  # the weights without the tokenizer files
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, d / "no_tokenizer" / f.name)
    return d


RUN = ["run", "--env", "qa_env:QA-v0", "--model", "tiny-bpe:64x2", "--run-dir", "out"]
CASES = {
    # name: (argv, what the one line must say)
    "model dir without a tokenizer": (["run", "--env", "qa_env:QA-v0", "--model", "no_tokenizer", "--run-dir", "out"],
                                      ["no_tokenizer holds weights but no tokenizer", "save_pretrained"]),
    "task row without an answer": (RUN + ["--set", "env.kwargs.tasks=no_answer.jsonl"],
                                   ["no_answer.jsonl:2", "missing ['answer']"]),
    "wrong --env-arg": (["rollout", "--env", "qa_env:QA-v0", "--model", "tiny-bpe:64x2", "--env-arg",
                         "taks=tasks.jsonl", "--out", "out"], ["takes no argument 'taks'", "did you mean 'tasks'"]),
    "wrong env.kwargs key": (RUN + ["--set", "env.kwargs.taks=tasks.jsonl"], ["did you mean 'tasks'"]),
    "tool without a type hint": (["run", "--env", "no_hint_env:NoHint-v0", "--model", "tiny-bpe:64x2", "--run-dir",
                                  "out"], ["no_hint_env.py:", "lookup", "item", "type hint"]),
    "--set run.wandb=true without wandb": (RUN + ["--set", "run.wandb=true"], ["pip install wandb"]),
    "./no/such/model": (RUN[:3] + ["--model", "./no/such/model", "--run-dir", "out"], ["no such directory"]),
    "hub model not downloaded": (RUN[:3] + ["--model", "qwen2.5-7b", "--run-dir", "out"],
                                 ["not available offline", "hf download Qwen/Qwen2.5-7B-Instruct"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_user_mistake_is_one_line_and_leaves_nothing(user_dir, case, tmp_path):
    if case.startswith("--set run.wandb") and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    argv, must_say = CASES[case]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-m", "agentenv.cli", *argv], cwd=user_dir, env=env, capture_output=True,
                       text=True, timeout=600)
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    print(f"\n{case} | {errors} | rc={r.returncode}")
    assert r.returncode != 0, r.stdout[-2000:]
    assert len(errors) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    for s in must_say:
        assert s in errors[0], (s, errors[0])
    assert not (user_dir / "out").exists()  # no half-made run directory, no output file
