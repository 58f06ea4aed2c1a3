"""ALFWorld env benchmark: reset/step timings, then the expert evaluation over valid_seen and valid_unseen.

Usage: ``python benchmarks/alfworld_env.py [--data-dir DIR] [--timing-games N] [--skip-eval] [--k K]``.
DIR defaults to ``$ALFWORLD_DATA``; without either the shipped 24-game sample is used (and the eval covers only it).

* Timings: for N games of valid_seen, a first reset (game not seen before in this process), a repeated reset of the
  same game, and every step of its walkthrough; printed as wall mean / median / max and mean process CPU time
  (the env's own cost when other jobs share the cores).
* Eval: the expert (:class:`agentenv.envs.alfworld_expert.ALFWorldExpert`) plays every game of each split k times
  through the common evaluation (:func:`agentenv.run.evaluation.evaluate` on the ``alfworld`` preset); prints success
  overall and per task type, and exits non-zero unless every game was won.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from agentenv.core.config import load_config
from agentenv.envs.alfworld import ALFWorldEnv
from agentenv.envs.alfworld_expert import ALFWorldExpert


def _stats(xs: list[tuple[float, float]]) -> str:
    wall, cpu = [w for w, _ in xs], [c for _, c in xs]
    return (f"wall mean {statistics.mean(wall) * 1e3:7.1f} ms  median {statistics.median(wall) * 1e3:7.1f} ms  "
            f"max {max(wall) * 1e3:7.1f} ms | cpu mean {statistics.mean(cpu) * 1e3:7.1f} ms  (n={len(xs)})")


class _Clock:
    """Wall and process-CPU time of a block: on a shared machine the CPU time is the env's own cost."""

    def __enter__(self):
        self.w, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.elapsed = (time.perf_counter() - self.w, time.process_time() - self.c)


def timings(data_dir: str | None, n_games: int) -> None:
    env = ALFWorldEnv("valid_seen", data_dir, expert=True)
    with _Clock() as c:
        env.reset(options={"game": 0})  # imports textworld/alfworld and loads fast-downward: reported apart
    print(f"first reset in process (imports, library load): wall {c.elapsed[0] * 1e3:.0f} ms, cpu {c.elapsed[1] * 1e3:.0f} ms")
    first, again, steps = [], [], []
    for i in range(1, min(n_games, len(env.games) - 1) + 1):
        with _Clock() as c:
            env.reset(options={"game": i})
        first.append(c.elapsed)
        with _Clock() as c:
            _, info = env.reset(options={"game": i})
        again.append(c.elapsed)
        done = False
        while not done:
            with _Clock() as c:
                _, _, term, trunc, info = env.step(f"<action>{info['expert_action']}</action>")
            steps.append(c.elapsed)
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
    ap.add_argument("--skip-eval", action="store_true")
    args = ap.parse_args(argv)

    timings(args.data_dir, args.timing_games)
    if args.skip_eval:
        return 0
    cpu0 = time.process_time()
    from agentenv.run.evaluation import evaluate

    cfg = load_config("alfworld", [], [f"eval.samples={args.k}"]
                      + ([f"env.kwargs.data_dir={args.data_dir}"] if args.data_dir else []))
    all_won = True
    for split in ("valid_seen", "valid_unseen"):
        m = evaluate(cfg, ALFWorldExpert(), split)
        print(f"\nexpert on {split}: {m['successes']}/{m['episodes']} won ({m['success_rate']:.1%}), "
              f"mean turns {m['turns_mean']:.1f}, wall {m['wall_s']:.0f} s")
        for task_type, n in m["episodes_by_type"].items():
            print(f"  {task_type:24s} {round(m['success_' + task_type] * n):4d}/{n:<4d}")
        lost = [game for game, (won, played) in m["task_successes"].items() if won < played]
        for game in lost:
            print(f"  NOT WON: game {game} of {split}")
        all_won &= not lost
    print(f"\neval process CPU time: {time.process_time() - cpu0:.0f} s")
    return 0 if all_won else 1


if __name__ == "__main__":
    sys.exit(main())
