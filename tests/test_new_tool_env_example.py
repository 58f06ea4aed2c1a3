"""The README's "Writing a new tool environment" section, used exactly as a new user would: its ``shop_env.py``
block is written to an empty directory, its usage block runs against it, and its training command runs there as a
subprocess (2 updates of the tiny model) and must leave a ``metrics.jsonl`` with the tool-call rate."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README.split("## Writing a new tool environment", 1)[1].split("\n## ", 1)[0]
PY_BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, re.S)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", SECTION, re.S)


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("user")
    module = next(b for b in PY_BLOCKS if b.startswith("# shop_env.py"))
    (d / "shop_env.py").write_text(module)
    return d


def test_readme_usage_block_runs(user_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(user_dir))
    usage = next(b for b in PY_BLOCKS if "gym.make(\"shop_env:Shop-v0\")" in b)
    scope: dict = {}
    exec(compile(usage, "README usage block", "exec"), scope)  # noqa: S102 -- the README's own example
    assert scope["reward"] == 1.0 and scope["info"]["success"]
    from gymnasium.utils.env_checker import check_env

    check_env(gym.make("Shop-v0").unwrapped)


def test_readme_training_command_trains_the_new_env(user_dir):
    [cmd] = [line for b in BASH_BLOCKS for line in b.splitlines() if line.startswith("agentenv run --env shop_env")]
    argv = shlex.split(cmd)
    assert argv[:4] == ["agentenv", "run", "--env", "shop_env:Shop-v0"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    # the console script, from a directory holding only the user's module
    exe = Path(sys.executable).with_name("agentenv")
    argv[0] = str(exe) if exe.exists() else "agentenv"
    r = subprocess.run(argv + ["--run-dir", "run", "--no-progress"], cwd=user_dir, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (user_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    updates = [x for x in rows if "update" in x and "event" not in x]
    assert [x["update"] for x in updates] == [1, 2]
    assert all("tool_call_rate" in x and 0.0 <= x["tool_call_rate"] <= 1.0 for x in updates)
    plan = json.loads((user_dir / "run" / "plan.json").read_text())
    summary = json.loads((user_dir / "run" / "summary.json").read_text())
    assert plan["env"] == "Shop-v0" and summary["components"] == plan["components"]  # the plan is what ran
    assert (user_dir / "run" / "final_model" / "config.json").exists()
    # the saved model is a model directory every command takes
    r = subprocess.run([argv[0], "rollout", "--env", "shop_env:Shop-v0", "--model", "run/final_model", "--episodes",
                        "2", "--max-new-tokens", "8", "--out", "r.jsonl"], cwd=user_dir, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "episodes=2" in r.stdout, r.stderr[-3000:]
    r = subprocess.run([argv[0], "run", "--env", "shop_env:Shop-v0", "--model", "run/final_model", "--eval-only",
                        "--set", "eval.episodes=2", "--set", "rollout.max_new_tokens=8", "--run-dir", "ev",
                        "--no-progress"], cwd=user_dir, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((user_dir / "ev" / "summary.json").read_text())["evals"][0]["episodes"] == 2
