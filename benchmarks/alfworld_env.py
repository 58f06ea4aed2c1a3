"""ALFWorld env benchmark: reset/step timings, then the expert evaluation over valid_seen and valid_unseen.

Usage: ``python benchmarks/alfworld_env.py [--data-dir DIR] [--timing-games N] [--skip-eval] [--k K]``.
DIR defaults to ``$ALFWORLD_DATA``; without either the shipped 24-game sample is used (and the eval covers only it).

* Timings: for N games of valid_seen, a first reset (game not seen before in this process), a repeated reset of the
  same game, and every step of its walkthrough; printed as mean / median / max.
* Eval: the expert (:class:`agentenv.envs.alfworld_expert.ALFWorldExpert`) plays every game of each split k times
  through :func:`agentenv.envs.alfworld.evaluate`, i.e. through :mod:`agentenv.runtime`; prints success overall and
  per task type, and exits non-zero unless every game was won.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from agentenv.envs.alfworld import ALFWorldEnv, evaluate
from agentenv.envs.alfworld_expert import ALFWorldExpert


def _stats(xs: list[float]) -> str:
    return f"mean {statistics.mean(xs) * 1e3:7.1f} ms   median {statistics.median(xs) * 1e3:7.1f} ms   max {max(xs) * 1e3:7.1f} ms   (n={len(xs)})"


def timings(data_dir: str | None, n_games: int) -> None:
    env = ALFWorldEnv("valid_seen", data_dir, expert=True)
    t0 = time.perf_counter()
    env.reset(options={"game": 0})  # imports textworld/alfworld and loads fast-downward: reported apart
    print(f"first reset in process (imports, library load): {(time.perf_counter() - t0) * 1e3:.0f} ms")
    first, again, steps = [], [], []
    for i in range(1, min(n_games, len(env.games) - 1) + 1):
        t0 = time.perf_counter()
        _, info = env.reset(options={"game": i})
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        _, info = env.reset(options={"game": i})
        again.append(time.perf_counter() - t0)
        done = False
        while not done:
            t0 = time.perf_counter()
            _, _, term, trunc, info = env.step(f"<action>{info['expert_action']}</action>")
            steps.append(time.perf_counter() - t0)
            done = term or trunc
    env.close()
    print(f"reset, new game:      {_stats(first)}")
    print(f"reset, same game:     {_stats(again)}")
    print(f"step (expert action): {_stats(steps)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--timing-games", type=int, default=20)
    ap.add_argument("--k", type=int, default=1, help="episodes per game in the eval")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--skip-eval", action="store_true")
    args = ap.parse_args(argv)

    timings(args.data_dir, args.timing_games)
    if args.skip_eval:
        return 0
    results = evaluate(ALFWorldExpert(), ("valid_seen", "valid_unseen"), k=args.k, data_dir=args.data_dir,
                       concurrency=args.concurrency, progress=True)
    all_won = True
    for split, r in results.items():
        trajs = r["trajectories"]
        turns = statistics.mean(t.num_turns for t in trajs)
        env_s = sum(t.time_env_s for t in trajs)
        print(f"\nexpert on {split}: {r['successes']}/{r['episodes']} won ({r['success_rate']:.1%}), mean turns {turns:.1f}, "
              f"wall {r['wall_time_s']:.0f} s (env {env_s:.0f} s)")
        for task_type, b in r["by_task_type"].items():
            print(f"  {task_type:24s} {b['successes']:4d}/{b['episodes']:<4d}")
        failed = [t for t in trajs if not t.success]
        for t in failed:
            print(f"  NOT WON: {t.task} ({t.finish_reason}{': ' + t.error if t.error else ''})")
        all_won &= not failed
    return 0 if all_won else 1


if __name__ == "__main__":
    sys.exit(main())
