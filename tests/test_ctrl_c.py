"""Ctrl-C (SIGINT) of ``agentenv run`` as a user presses it: during the loop, and during a rollout outside the loop
(the evaluation at the start, which stops at once). Either way the process exits 130, cleanly: no C++ abort at interpreter exit
("terminate called without an active exception"), and inside the loop a checkpoint and the model are saved."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXE = Path(sys.executable).with_name("agentenv")


def _run_and_interrupt(args, ready, tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        # SIGINT as at a terminal: a suite started in the background (`cmd &` in a script) inherits SIGINT ignored,
        # and Python then installs no KeyboardInterrupt handler, so the child would never see the Ctrl-C.
        p = subprocess.Popen([str(EXE) if EXE.exists() else "agentenv", *args], stdout=f, stderr=subprocess.STDOUT,
                             env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and p.poll() is None and not ready(log.read_text()):
            time.sleep(0.2)
        assert p.poll() is None, log.read_text()[-3000:]
        p.send_signal(signal.SIGINT)
        rc = p.wait(300)
    return rc, log.read_text()


def test_ctrl_c_in_the_loop_saves_and_exits_130(tmp_path):
    run = tmp_path / "run"
    rc, out = _run_and_interrupt(["run", "--env", "guess", "--model", "tiny", "--no-progress", "--run-dir", str(run),
                                  "--set", "loop.batch_size=2", "--set", "loop.total_updates=100",
                                  "--set", "rollout.max_new_tokens=16"],
                                 lambda s: "[update 1]" in s, tmp_path)
    assert rc == 130, out[-3000:]
    assert "terminate called" not in out and "Traceback" not in out
    assert (run / "checkpoints" / "latest").exists() and (run / "final_model" / "config.json").exists()
    assert "agentenv run --resume" in out
    assert "leftover_threads=0" in out


def test_ctrl_c_during_a_rollout_outside_the_loop_exits_130_cleanly(tmp_path):
    rc, out = _run_and_interrupt(["run", "--env", "python", "--model", "tiny", "--no-progress",
                                  "--run-dir", str(tmp_path / "run"), "--set", "loop.batch_size=2",
                                  "--set", "eval.episodes=32"],
                                 # the start-of-run evaluation is under way (its log line comes just before)
                                 lambda s: "run dir" in s and "agentenv.run.evaluation: eval " in s, tmp_path)
    assert rc == 130, out[-3000:]
    assert "terminate called" not in out and "interrupted" in out
    # the evaluation stops at the first Ctrl-C (it has no update to finish), it does not play out its 32 episodes
    assert "[eval update=0" not in out, out[-3000:]
