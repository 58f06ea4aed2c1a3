"""Async single-rollout vs synchronous groups (G = 8) under heavy-tailed env latency, through the REAL training loop.

Both runs drive :class:`agentenv.trainer.async_loop.Trainer` (workers, dispatch, completion buffer, accounting,
metrics) unchanged; only the three ends are stand-ins so the measurement is about scheduling, not about a model:

* env: each step sleeps a lognormal latency (median ``--median-ms``, shape ``--sigma``; p99/p50 = exp(2.326 sigma),
  the measured ratio over all steps actually taken is printed), ``--turns`` steps per episode;
* policy: a text policy that answers instantly (generation cost ~0, so env latency is the whole rollout time);
* learner: sleeps ``--learner-s`` per update (a fixed-cost GPU step) and bumps the policy version.

Same workers x concurrency for both; batch = all rollout slots. Reported: trajectories consumed per second and the
learner's busy fraction (time inside update / wall time since the loop started, fill-up included).
Last line: ``async/sync throughput ratio: X; learner busy async A%, sync S%``.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import gymnasium as gym
import numpy as np
from agentenv.trainer.async_loop import TrainConfig, Trainer

from agentenv.runtime import RolloutConfig, Task

_LAT_LOCK = threading.Lock()
LATENCIES: list[float] = []


class SlowEnv(gym.Env):
    """A text env whose steps take a heavy-tailed time. Reward 1 on the last turn with probability 1/2."""

    metadata = {"render_modes": []}  # noqa: RUF012 -- gymnasium's class attribute

    def __init__(self, median_s: float, sigma: float, turns: int):
        self.median_s, self.sigma, self.turns = median_s, sigma, turns
        self.rng = np.random.default_rng()
        self.t = 0

    def reset(self, *, seed=None, options=None):
        self.rng = np.random.default_rng([seed or 0, int(time.perf_counter_ns() % 2**32)])
        self.t = 0
        return "go", {"task": f"sim-{seed}"}

    def step(self, action):
        lat = self.median_s * float(np.exp(self.sigma * self.rng.standard_normal()))
        time.sleep(lat)
        with _LAT_LOCK:
            LATENCIES.append(lat)
        self.t += 1
        done = self.t >= self.turns
        return "ok", float(done and self.rng.random() < 0.5), done, False, {"success": done}


class InstantPolicy:
    """Text policy stand-in: answers at once; keeps the published version like a real sampler."""

    name = "instant"

    def __init__(self, worker_index: int = 0):
        self.policy_version = 0

    def act(self, messages, info) -> str:
        return "step"

    def load_weights(self, state_dict, version):
        self.policy_version = version


class SleepLearner:
    """Learner stand-in with the Learner's interface: a fixed-duration update, one version bump per batch."""

    def __init__(self, seconds: float):
        self.seconds, self.policy_version, self.step = seconds, 0, 0

    def update(self, trajectories):
        time.sleep(self.seconds)
        self.step += 1
        self.policy_version += 1
        return {"num_admitted": len(trajectories), "loss": 0.0}

    def export_weights(self):
        return {}

    def state_dict(self):
        return {"step": self.step, "policy_version": self.policy_version}

    def load_state_dict(self, s):
        self.step, self.policy_version = s["step"], s["policy_version"]


def run(mode: str, args) -> dict:
    slots = args.workers * args.concurrency
    cfg = TrainConfig(mode=mode, batch_size=slots, group_size=args.group_size, queue_size=args.queue_size,
                      num_workers=args.workers, concurrency=args.concurrency,
                      total_updates=args.async_updates if mode == "async" else args.sync_updates,
                      seed=0, poll_interval_s=0.002, episode_timeout_s=60.0,
                      rollout=RolloutConfig(max_turns=args.turns + 1))
    tr = Trainer(cfg, make_env=lambda: SlowEnv(args.median_ms / 1000, args.sigma, args.turns),
                 make_policy=InstantPolicy, learner=SleepLearner(args.learner_s),
                 tasks=[Task(seed=i) for i in range(4096)])
    s = tr.run()
    lags = [m["lag_mean"] for m in tr.history]
    s["lag_mean"] = float(np.mean(lags)) if lags else 0.0
    s["lag_max"] = max((m["lag_max"] for m in tr.history), default=0)
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16, help="episodes in flight per worker")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--queue-size", type=int, default=2)
    p.add_argument("--turns", type=int, default=4, help="env steps per episode")
    p.add_argument("--median-ms", type=float, default=15.0)
    p.add_argument("--sigma", type=float, default=1.2, help="lognormal shape; p99/p50 = exp(2.326 sigma)")
    p.add_argument("--learner-s", type=float, default=0.25, help="stand-in learner seconds per update")
    p.add_argument("--async-updates", type=int, default=40)
    p.add_argument("--sync-updates", type=int, default=12)
    p.add_argument("-v", "--verbose", action="store_true", help="log every update")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    logging.getLogger("agentenv.runtime").setLevel(logging.ERROR)  # episodes cancelled at shutdown are expected

    slots = args.workers * args.concurrency
    print(f"workers={args.workers} concurrency={args.concurrency} (slots={slots}) batch={slots} G={args.group_size} "
          f"Q={args.queue_size} turns={args.turns} step~lognormal(median={args.median_ms}ms, sigma={args.sigma}) "
          f"learner={args.learner_s}s/update")
    res = {}
    for mode in ("async", "sync_grpo"):
        t0 = time.perf_counter()
        res[mode] = run(mode, args)
        res[mode]["wall"] = time.perf_counter() - t0
    lat = np.array(LATENCIES)
    p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
    print(f"env step latency over {len(lat)} steps: p50={p50 * 1000:.1f}ms p99={p99 * 1000:.1f}ms "
          f"p99/p50={p99 / p50:.1f}")
    print(f"{'mode':<12}{'updates':>8}{'traj/s':>10}{'learner busy':>14}{'lag mean':>10}{'lag max':>9}{'wall s':>8}")
    for mode, s in res.items():
        print(f"{mode:<12}{s['updates']:>8}{s['traj_per_s']:>10.1f}{100 * s['learner_busy']:>13.1f}%"
              f"{s['lag_mean']:>10.2f}{s['lag_max']:>9}{s['wall']:>8.1f}")
        assert s["accounting_balance"] == 0, s
    a, b = res["async"], res["sync_grpo"]
    print(f"async/sync throughput ratio: {a['traj_per_s'] / b['traj_per_s']:.2f}; "
          f"learner busy async {100 * a['learner_busy']:.1f}%, sync {100 * b['learner_busy']:.1f}%")


if __name__ == "__main__":
    main()
