"""``agentenv run --resume RUN_DIR`` after SIGKILL: once in the middle of a checkpoint write, once in the middle of an
update after a checkpoint. The resumed run continues the step counter, leaves no partial checkpoint file, and the
run's files say exactly once what the surviving run trained (rows of rolled-back updates are marked)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agentenv.core.trajectory import read_jsonl

EXE = Path(sys.executable).with_name("agentenv")
BASE = ["run", "--env", "guess", "--model", "tiny", "--no-progress", "--set", "loop.batch_size=2",
        "--set", "loop.checkpoint_every=1", "--set", "rollout.max_new_tokens=8", "--set", "eval.at_end=false",
        "--set", "run.plot=false"]


def _cmd(*args):
    return [str(EXE) if EXE.exists() else "agentenv", *args]


def _updates(run):
    p = run / "metrics.jsonl"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return [r["update"] for r in rows if "update" in r and "event" not in r and not r.get("rolled_back")]


def _kill_when(proc, cond, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    proc.kill()
    return False


def test_sigkill_mid_checkpoint_and_mid_update_then_resume(tmp_path):
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}

    # 1. killed while a checkpoint file is being written (its temporary file exists)
    p = subprocess.Popen(_cmd(*BASE, "--set", "loop.total_updates=8", "--run-dir", str(run)), env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    caught = _kill_when(p, lambda: ckpts.is_dir() and (ckpts / "latest").exists()
                        and any(ckpts.glob(".step_*.tmp")))
    assert caught, "no checkpoint write was in progress to kill"
    assert any(ckpts.glob(".step_*.tmp"))  # the crash left a partial file behind
    done_before = max(_updates(run))

    # 2. resumed, then killed mid-update (a metrics row past the latest checkpoint exists, the next one is running)
    p = subprocess.Popen(_cmd("run", "--resume", str(run), "--no-progress", "--set", "loop.checkpoint_every=3"),
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def past_checkpoint():
        name = (ckpts / "latest").read_text().strip() if (ckpts / "latest").exists() else ""
        step = int(name[5:11]) if name.startswith("step_") else 0
        ups = _updates(run)
        return bool(ups) and max(ups) > done_before and max(ups) > step

    assert _kill_when(p, past_checkpoint), "the resumed run did not get past its first checkpoint"
    assert not any(ckpts.glob(".step_*.tmp")), "the resumed run must remove the crash's partial checkpoint"

    # 3. resumed to the end
    r = subprocess.run(_cmd("run", "--resume", str(run), "--no-progress"), env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed step=" in r.stderr
    assert _updates(run) == list(range(1, 9))  # each update exactly once, in order
    trained = [t for t in read_jsonl(run / "trajectories.jsonl")
               if not t.meta.get("rolled_back") and t.meta["loop"]["status"] in ("trained", "rejected")]
    per_update = {}
    for t in trained:
        per_update[t.meta["loop"]["update"]] = per_update.get(t.meta["loop"]["update"], 0) + 1
    assert per_update == {u: 2 for u in range(1, 9)}  # batch_size rows per surviving update, none twice
    rolled = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(x.get("rolled_back") for x in rolled)  # the killed updates are marked, not silently duplicated
    summary = json.loads((run / "summary.json").read_text())["summary"]
    assert summary["updates"] == 8 and summary["accounting_balance"] == 0
    assert not any(ckpts.glob(".*.tmp"))
