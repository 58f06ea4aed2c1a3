"""The before/after report of a training run: what ``agentenv demo`` prints (and any run that evaluates at its start
and end): curves over updates as sparklines, the evaluation before and after RL side by side, the wall time, and
``RUN/demo_result.json``. It drives :func:`agentenv.train.run`; it computes nothing of its own."""

from __future__ import annotations

import json
import time

from agentenv.plot import ascii_curve
from agentenv.train import run


def run_demo(cfg, *, progress: bool = True, echo=print) -> int:
    """``agentenv demo``: SFT warm start + FlashREINFORCE; prints before/after and curves."""
    t0 = time.perf_counter()
    echo(f"agentenv demo: model {cfg.model.name}, {cfg.loop.total_updates} updates x {cfg.loop.batch_size} "
         f"trajectories, SFT warm start on {cfg.sft.num_demos} scripted demos ({cfg.sft.tool_fraction:.0%} use the tool)")
    res = run(cfg, progress=progress, echo=echo)
    wall = time.perf_counter() - t0
    before = next((e for e in res.evals if e["update"] == 0), None)
    after = next((e for e in reversed(res.evals) if e["update"] > 0), None)
    h = res.history
    echo("")
    echo("curves over updates (batch values, 0..1):")
    for key, label in (("success_rate", "success  "), ("tool_share", "tool rate"), ("acceptance_rate", "accepted ")):
        vals = [float(m.get(key, 0.0)) for m in h]
        if vals:
            echo(f"  {label} {ascii_curve(vals)}  {vals[0]:.2f} -> {sum(vals[-5:]) / len(vals[-5:]):.2f} (last 5)")
    if before and after:
        echo("")
        echo(f"                 warm start (SFT)   after {res.summary.get('updates', len(h))} RL updates")
        echo(f"  success        {before['success_rate']:14.2f}   {after['success_rate']:10.2f}")
        echo(f"  tool-call rate {before['tool_share']:14.2f}   {after['tool_share']:10.2f}")
        echo(f"  (eval on {before['episodes']} tasks each)")
    echo(f"wall time {wall:.0f}s; run dir {res.run_dir}; plot {res.run_dir / 'curves.png'}")
    (res.run_dir / "demo_result.json").write_text(json.dumps(
        {"before": before, "after": after, "wall_s": wall, "updates": len(h)}, indent=2))
    return 0
