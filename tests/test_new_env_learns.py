"""A new user's env, from an empty directory to a learned tool-call rate, by the README's "Warm-start and train it"
section alone: its ``vault_env.py`` and ``solver.py`` blocks are written to an empty directory and its bash block's
commands run there as written with the ``agentenv`` console script: ``rollout --model solver:weak --demos`` (the
scripted player's demos), SFT on them, then FlashREINFORCE. The run's ``metrics.jsonl`` must show the tool-call rate rising: the mean over the last 4 updates at
least 0.25 above the mean over the first 4. An unchanged policy cannot pass that: with the rate near 0.4 and 16
trajectories an update, the difference of two 4-update means has a standard deviation of about 0.09 (0.25 is ~2.9).

STATUS: marked ``slow`` (deselected by pyproject's addopts, so not in CI) because it does NOT pass yet: the
warm start never learns to copy. Tool calls get the format right but the vault number in the arguments and the code
in the answer are random digits, so rewards stay ~0 (a few 1s in 256 episodes) and the rate only wanders. Measured
on 2 loaded CPU cores (issue 42), SFT tool-demo loss per token (0.19-0.21 is "digits not copied"; copying would
bring it to ~0.03) and the RL rate over the first/last 4 of 16 updates:

* this walk (tiny-bpe:64x2, 150 steps, lr 3e-3): overall loss 0.28, RL 0.44 -> 0.47, 1 success in 256;
* 64x2, 2000 steps (40 epochs): tool loss 0.30 -> 0.26, then 2 of 30 calls named the right vault, 0 answers copied;
* 64x2, 200 steps: tool loss 0.31; tiny-bpe:128x2, 150 steps: overall 0.29, 0 of 27 tool calls named the right vault;
* 9 vaults (one-digit numbers), 64x2, 300 steps: tool loss 0.17, and still 1 of 25 calls named the right vault;
* no tool argument at all (the tool reads the env's current task), 64x2: 400 steps tool loss 0.21, RL 0.45 -> 0.66
  with 2 successes in 256 (lr 6e-3: 0.22, RL 0.36 -> 0.34); 550 steps 0.19; the answer written as the tool's own
  sentence ("The code is 27.", for an induction head), 600 steps: 0.19, RL 0.47 -> 0.64 with 4 successes.

Copying is what costs: the CPU demo needs 800 steps of tiny-bpe:128x4 at batch 16 for it. A run of that size did not
fit the session (unloaded, 64x2 runs 400 steps in ~30 s; loaded, ~2-3 s a step); sizing the walk is open.

``AGENTENV_TEST_SEED=S`` adds ``--seed S`` / ``--set loop.seed=S`` to the commands (checking other seeds by hand), and
``AGENTENV_TEST_EXTRA="--set algo.lr=1e-9"`` appends to the ``run`` command (checking that it fails without
learning)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README.split("## Warm-start and train it", 1)[1].split("\n## ", 1)[0]
PY_BLOCKS = re.findall(r"```python\n(.*?)```", SECTION, re.S)
[BASH] = re.findall(r"```bash\n(.*?)```", SECTION, re.S)


def _argv(line: str) -> list[str]:
    argv = shlex.split(line)
    seed, extra = os.environ.get("AGENTENV_TEST_SEED"), os.environ.get("AGENTENV_TEST_EXTRA", "")
    exe = Path(sys.executable).with_name("agentenv")
    argv[0] = str(exe) if exe.exists() else "agentenv"
    if seed and argv[1] == "sft":
        argv += ["--seed", seed]
    if argv[1] == "run":
        argv += (["--set", f"loop.seed={seed}"] if seed else []) + shlex.split(extra)
    return argv


@pytest.mark.slow
def test_readme_walk_warm_starts_and_trains_a_new_env_until_it_calls_its_tool(tmp_path):
    for block in PY_BLOCKS:  # each file block opens with "# NAME.py -- ..."
        name = block.split()[1]
        (tmp_path / name).write_text(block)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["solver.py", "vault_env.py"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    lines = [x for x in BASH.splitlines() if x.strip() and not x.startswith("#")]
    assert [shlex.split(x)[:2] for x in lines] == [["agentenv", "rollout"], ["agentenv", "sft"], ["agentenv", "run"]]
    for line in lines:
        r = subprocess.run(_argv(line), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (line, r.stderr[-3000:])
        print(r.stdout.strip().splitlines()[-1])
    run = tmp_path / "runs" / "vault"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [x["tool_call_rate"] for x in rows if "update" in x and "event" not in x]
    early, late = sum(rates[:4]) / 4, sum(rates[-4:]) / 4
    print(f"tool_call_rate per update: {' '.join(f'{r:.2f}' for r in rates)}; first 4 {early:.3f}, last 4 {late:.3f}")
    assert len(rates) == 16
    assert late - early >= 0.25, (early, late, rates)
    summary = json.loads((run / "summary.json").read_text())["summary"]
    assert summary["optimizer_steps"] > 0 and not summary["no_learning_warning"]
    assert (run / "curves.png").exists() and (tmp_path / "warm" / "config.json").exists()
