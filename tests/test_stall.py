"""No silent non-learning: the untrained tiny model on the README's shop env never earns a reward, so its updates
cannot learn; the run says so once, with the fix, and ``summary.json`` counts optimizer steps taken vs skipped."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from agentenv.core.stall import NoLearningWatch, step_counts

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTION = README.split("## Writing a new tool environment", 1)[1].split("\n## ", 1)[0]
SHOP_ENV = next(b for b in re.findall(r"```python\n(.*?)```", SECTION, re.S) if b.startswith("# shop_env.py"))


def rec(lo: float, hi: float, skipped: int) -> dict:
    return {"reward_min": lo, "reward_max": hi, "optimizer_step_skipped": skipped}


def test_the_watch_warns_once_with_the_reason(caplog):
    w = NoLearningWatch(3)
    assert [w.observe(rec(0, 0, 1)) for _ in range(2)] == [None, None]
    assert w.observe(rec(0, 1, 0)) is None  # a batch that can learn resets the count
    with caplog.at_level(logging.WARNING, logger="agentenv.core.stall"):
        said = [w.observe(rec(0, 0, 1)) for _ in range(5)]
    assert said[:2] == [None, None] and said[3:] == [None, None]  # once
    assert "every reward in the last 3 batches is 0" in said[2] and "agentenv sft" in said[2]
    assert [r.getMessage() for r in caplog.records] == [f"NO LEARNING: {said[2]}"]
    w = NoLearningWatch(2)
    assert w.observe(rec(1, 1, 0)) is None and "same reward (1)" in w.observe(rec(1, 1, 0))
    w = NoLearningWatch(2)
    assert w.observe(rec(0, 1, 1)) is None and "trust gate admitted nothing" in w.observe(rec(0, 1, 1))
    assert step_counts([rec(0, 0, 1), rec(0, 1, 0), rec(0, 0, 1)]) == {"optimizer_steps": 1, "optimizer_steps_skipped": 2}


def test_a_run_that_never_reaches_a_reward_says_so(tmp_path, monkeypatch, caplog):
    from agentenv.cli import main

    (tmp_path / "shop_env.py").write_text(SHOP_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="agentenv.core.stall"):
        rc = main(["run", "--env", "shop_env:Shop-v0", "--model", "tiny", "--run-dir", "run", "--no-progress",
                   "--set", "loop.total_updates=3", "--set", "loop.batch_size=4", "--set", "rollout.max_new_tokens=8",
                   "--set", "run.no_learning_updates=2", "--set", "run.plot=false", "--set", "eval.at_end=false"])
    assert rc == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == "agentenv.core.stall"]
    assert len(warnings) == 1 and "every reward in the last 2 batches is 0" in warnings[0], warnings
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["summary"]
    assert summary["optimizer_steps"] == 0 and summary["optimizer_steps_skipped"] == 3
    assert summary["no_learning_warning"] == warnings[0].removeprefix("NO LEARNING: ")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["no_learning_alarm"] for r in rows if "update" in r and "event" not in r] == [0, 1, 0]
