"""Pooled evidence for RL on ALFWorld: N RL runs from ONE warm start, each paired game by game with that warm start.

Why: one `agentenv demo --env alfworld` run answers "did this run's RL beat its warm start?" with a paired interval
about +-0.05 wide on valid_unseen (42 games), and RL's effect in the CPU miniature has been smaller than that
(docs/experiments/alfworld_demo_log.md). This asks the question about the procedure instead: the same warm start, N RL runs that
differ only in ``loop.seed`` (prompt order and sampling), every evaluation on the same games.

Two modes:

  python benchmarks/alfworld_pooled.py run --warm-start RUN/sft_model --runs 3 --out /tmp/pooled [--set k=v ...]
      evaluates the warm start once (``--baseline-samples`` plays per game), then N RL runs of the ``alfworld_demo``
      preset from it (``sft.enabled=false``; ``--updates``, ``--samples`` plays per game at the end), then pools.
      A rerun with the same ``--out`` reuses every evaluation already finished, so a stopped study loses nothing.
  python benchmarks/alfworld_pooled.py pool --before RUN_OR_EVAL_JSONL... --after RUN_OR_EVAL_JSONL...
      pools evaluations that already exist (each ``--before`` at update 0, each ``--after`` at its last evaluated
      update or at ``--update``).

Pooling (agentenv.run.report): per game, successes and episodes are summed over the warm start's evaluations and over
the runs' final ones; the change is the mean over games of (after rate - before rate). Two intervals are printed:
runs pooled as one policy (bootstrap over games, :func:`paired_difference_interval`) and runs then games resampled
(:func:`runs_and_tasks_interval`), which also carries the run-to-run spread; with three or more runs, read the second.
Each run's own paired change is listed too, so one lucky run cannot hide in the pool. Output: the table on stdout,
``OUT/pooled.json`` and ``OUT/pooled.md`` (the report with settings, wall times and the machine).

``--smoke`` runs the code path on the shipped games in a minute (an untrained 64 x 2 model, 2 runs of 1 update, 2
eval games): what CI runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from agentenv.run.report import paired_difference_interval, pool_task_successes, runs_and_tasks_interval

SMOKE_SETS = ["loop.batch_size=2", "loop.concurrency=2", "eval.episodes=2", "env.num_tasks=4", "run.threads=2"]


def read_evals(path: str | Path, split: str, update: int | None = None) -> dict:
    """One evaluation of ``split`` from a run directory or an ``eval.jsonl``: at ``update``, else the last one."""
    p = Path(path)
    p = p / "eval.jsonl" if p.is_dir() else p
    if not p.exists():
        raise FileNotFoundError(f"{p}: no evaluations there (a run writes eval.jsonl when it evaluates)")
    evals = [e for e in map(json.loads, p.read_text().splitlines()) if e.get("split") == split]
    if update is not None:
        evals = [e for e in evals if e.get("update") == update]
    if not evals:
        raise ValueError(f"{p}: no evaluation of {split}" + (f" at update {update}" if update is not None else ""))
    return {**evals[-1], "source": str(path)}


def mean_change(before: dict, after: dict) -> float:
    """Mean over the games both played of (after rate - before rate): the point estimate the intervals are around."""
    keys = [k for k in before if k in after]
    return sum(after[k][0] / after[k][1] - before[k][0] / before[k][1] for k in keys) / len(keys)


def pool(before: list[dict], after: list[dict]) -> dict:
    """The pooled comparison as plain data (what the report prints and pooled.json holds)."""
    b, a = pool_task_successes(before), pool_task_successes(after)
    runs = []
    for ev in after:
        lo, hi, _ = paired_difference_interval(b, ev["task_successes"])
        runs.append({"source": ev["source"], "update": ev.get("update"), "successes": ev["successes"],
                     "episodes": ev["episodes"], "change": mean_change(b, ev["task_successes"]), "interval": [lo, hi]})
    lo1, hi1, tasks = paired_difference_interval(b, a)
    lo2, hi2, _ = runs_and_tasks_interval(b, [ev["task_successes"] for ev in after])
    common = [k for k in b if k in a]
    changes = [r["change"] for r in runs]
    return {
        "split": after[0]["split"], "tasks": tasks,
        "before": {"successes": sum(b[k][0] for k in common), "episodes": sum(b[k][1] for k in common),
                   "sources": [e["source"] for e in before]},
        "after": {"successes": sum(a[k][0] for k in common), "episodes": sum(a[k][1] for k in common)},
        "change": mean_change(b, a), "interval_runs_as_one": [lo1, hi1], "interval_runs_and_tasks": [lo2, hi2],
        "run_changes_mean": statistics.fmean(changes),
        "run_changes_std": statistics.stdev(changes) if len(changes) > 1 else 0.0, "runs": runs,
    }


def table(res: dict) -> list[str]:
    f = lambda lo_hi: f"[{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]"  # noqa: E731
    b, a = res["before"], res["after"]
    lines = [f"{res['split']}: {res['tasks']} games, paired by game (change = mean over games of after - before)",
             f"  warm start (pooled over {len(b['sources'])} evaluation(s)): {b['successes']} / {b['episodes']} "
             f"({b['successes'] / b['episodes']:.3f})"]
    for i, r in enumerate(res["runs"]):
        lines.append(f"  run {i} (update {r['update']}): {r['successes']} / {r['episodes']}  change "
                     f"{r['change']:+.3f} {f(r['interval'])}  {r['source']}")
    lines += [f"  runs pooled: {a['successes']} / {a['episodes']} ({a['successes'] / a['episodes']:.3f})  change "
              f"{res['change']:+.3f}",
              f"    95% bootstrap over games, runs as one policy: {f(res['interval_runs_as_one'])}",
              f"    95% bootstrap over runs, then games:          {f(res['interval_runs_and_tasks'])}",
              f"  per-run changes: mean {res['run_changes_mean']:+.3f} +- {res['run_changes_std']:.3f} (std over "
              f"{len(res['runs'])} runs)"]
    return lines


def write_report(out: Path, res: dict, settings: dict) -> None:
    (out / "pooled.json").write_text(json.dumps({**res, "settings": settings}, indent=1))
    md = [f"# Pooled RL runs from one ALFWorld warm start ({date.today().isoformat()})", "",
          f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}.", "",
          "Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()), "", "```", *table(res), "```", ""]
    (out / "pooled.md").write_text("\n".join(md))


def _run(sets: list[str], *, eval_only: bool = False) -> float:
    """One `agentenv run --preset alfworld_demo` in this process; returns its wall time."""
    from agentenv.core.config import load_config
    from agentenv.run.train import run

    cfg = load_config("alfworld_demo", [], sets)
    t0 = time.perf_counter()
    run(cfg, eval_only=eval_only, progress=False, echo=lambda *_: None)
    return time.perf_counter() - t0


def study(args) -> int:
    out = Path(args.out or tempfile.mkdtemp(prefix="alfworld_pooled_"))
    out.mkdir(parents=True, exist_ok=True)
    common = [f"model.name={args.warm_start}", "sft.enabled=false", "eval.at_start=false",
              f"eval.splits=[{args.split}]", "run.tensorboard=false", *args.set]
    wall = {}
    base_dir = out / "warm_start"
    if not (base_dir / "eval.jsonl").exists():
        print(f"[pooled] evaluating the warm start {args.warm_start} ({args.baseline_samples} plays per game)", flush=True)
        wall["warm_start_eval_s"] = _run([*common, f"eval.samples={args.baseline_samples}", f"run.dir={base_dir}"],
                                         eval_only=True)
    afters = []
    for i in range(args.first_seed, args.first_seed + args.runs):
        rd = out / f"rl_seed{i}"
        try:
            afters.append(read_evals(rd, args.split, args.updates))
            continue  # finished in an earlier invocation
        except (FileNotFoundError, ValueError):
            pass
        if rd.exists():  # an unfinished run: start it again rather than append to it
            import shutil

            shutil.rmtree(rd)
        print(f"[pooled] RL run {i - args.first_seed + 1}/{args.runs}: loop.seed={i}, {args.updates} updates", flush=True)
        wall[f"rl_seed{i}_s"] = _run([*common, f"loop.seed={i}", f"loop.total_updates={args.updates}",
                                      f"eval.samples={args.samples}", "eval.at_end=true", f"run.dir={rd}"])
        afters.append(read_evals(rd, args.split, args.updates))
    res = pool([read_evals(base_dir, args.split, 0)], afters)
    print("\n".join(table(res)))
    settings = {"warm_start": args.warm_start, "runs": args.runs, "first_seed": args.first_seed,
                "updates": args.updates, "samples": args.samples, "baseline_samples": args.baseline_samples, "set": " ".join(args.set),
                **{k: round(v, 1) for k, v in wall.items()}}
    write_report(out, res, settings)
    print(f"[pooled] report: {out / 'pooled.md'}")
    if args.smoke:  # the code path's own check: the pool is the sum of its runs
        ok = res["after"]["episodes"] == sum(r["episodes"] for r in res["runs"]) and len(res["runs"]) == args.runs
        print("[pooled] smoke " + ("ok" if ok else "FAILED: the pooled counts are not the sum of the runs"))
        return 0 if ok else 1
    return 0


def pool_existing(args) -> int:
    res = pool([read_evals(p, args.split, 0) for p in args.before], [read_evals(p, args.split, args.update)
                                                                     for p in args.after])
    print("\n".join(table(res)))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_report(Path(args.out), res, {"before": " ".join(args.before), "after": " ".join(args.after)})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="evaluate a warm start, run N RL runs from it, pool")
    r.add_argument("--warm-start", help="model directory (a run's sft_model) or built-in name")
    r.add_argument("--runs", type=int, default=3)
    r.add_argument("--first-seed", type=int, default=0,
                   help="loop.seed of the first run (the next runs count up): 1 to add runs beside a demo run's seed 0")
    r.add_argument("--updates", type=int, default=48)
    # 16: the demo's valid_unseen evaluation (at 4 plays one evaluation moves by about RL's whole effect)
    r.add_argument("--samples", type=int, default=16, help="plays per game in each run's final evaluation")
    r.add_argument("--baseline-samples", type=int, default=16, help="plays per game of the warm start's evaluation")
    r.add_argument("--split", default="valid_unseen")
    r.add_argument("--out", help="study directory (default: a new temporary one)")
    r.add_argument("--set", action="append", default=[], help="extra preset override, e.g. env.num_tasks=1098")
    r.add_argument("--smoke", action="store_true", help="the code path in a minute on the shipped games (CI)")
    p = sub.add_parser("pool", help="pool evaluations that already exist")
    p.add_argument("--before", nargs="+", required=True,
                   help="the warm start's run dirs or eval.jsonl files (their evaluation at update 0)")
    p.add_argument("--after", nargs="+", required=True, help="the RL runs' run dirs or eval.jsonl files")
    p.add_argument("--update", type=int, help="evaluation of the RL runs at this update (default: each one's last)")
    p.add_argument("--split", default="valid_unseen")
    p.add_argument("--out", help="also write pooled.json / pooled.md here")
    args = ap.parse_args(argv)
    if args.mode == "pool":
        return pool_existing(args)
    if args.smoke:
        os.environ.pop("ALFWORLD_DATA", None)  # the shipped games
        args.warm_start = args.warm_start or "tiny-bpe-alfworld:64x2"
        args.runs, args.updates, args.samples, args.baseline_samples = 2, 1, 1, 1
        args.set = [*SMOKE_SETS, *args.set]
    elif not args.warm_start:
        ap.error("run needs --warm-start (e.g. RUN/sft_model of an `agentenv demo --env alfworld` run)")
    if args.runs < 1 or args.updates < 1 or args.samples < 1 or args.baseline_samples < 1:
        ap.error("--runs, --updates, --samples and --baseline-samples must be >= 1")
    return study(args)


if __name__ == "__main__":
    sys.exit(main())
