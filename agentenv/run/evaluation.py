"""Evaluation: play every task of a split (``eval.samples`` times each, or the split's own number when that is a
per-split mapping) and summarise with the batch statistics.

:func:`evaluate(cfg, policy, split)` builds the split's env and tasks through :mod:`agentenv.run.episodes`, runs them
through :func:`agentenv.core.runtime.run_episodes` at the eval sampling settings (``eval.temperature`` / ``eval.top_p``,
else the rollout's), and returns :func:`agentenv.core.metrics.batch_metrics` of the trajectories (success, per-type
success, tool-call rate, ...) plus ``episodes``, ``successes``, ``episodes_by_type`` (episodes per task type, for
confidence intervals of ``success_<type>``), ``task_successes`` (``{task index: [successes, episodes]}``, string
keys so it survives JSON: what lets a before/after comparison pair each task with itself) and ``wall_s``.
``split=None`` evaluates on the training tasks. With ``eval.seed`` set (the default, 0) every play draws from its own
seeded stream (:attr:`agentenv.core.runtime.EpisodeSpec.sampling_seed`): the same weights give the same episodes whatever the
batching (to float rounding), and two weights meet the same random numbers (a repeatable comparison; it does not
promise a narrower paired interval).
With ``eval.samplers`` = k > 1 the plays are dealt round-robin to the policy and k-1 copies of it
(:meth:`agentenv.samplers.hf_policy.HFPolicy.replica`), each sampling on its own thread with 1/k of the torch threads (restored
afterwards); seeded plays score the same whichever copy plays them.
The same function serves periodic evaluation during a run, ``agentenv run --eval-only``, ``agentenv eval`` and a
scripted player's evaluation (the ALFWorld expert: the envs are built with the policy's ``env_kwargs``).
The policy must already hold the weights to evaluate (the run loads the learner's current weights into it). A
policy with ``play_episodes(make_env, tasks, rollout)`` plays the episodes itself: during a run, that is the run's
rollout samplers (:meth:`agentenv.trainer.loop.Trainer.play`), so evaluation never starts an engine of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from agentenv.core.config import RunConfig
from agentenv.run.episodes import EpisodeSet

log = logging.getLogger(__name__)


def evaluate(cfg: RunConfig, policy, split: str | None = None, *, limit: int | None = None,
             samples: int | None = None, progress: bool = True) -> dict:
    from agentenv.core.metrics import batch_metrics
    from agentenv.core.turns import mix_seed

    episodes = EpisodeSet.of(cfg, split, eval=True, limit=limit or cfg.eval.episodes,
                             samples=samples or cfg.eval.samples_for(split)).for_policy(policy)
    if cfg.eval.seed is not None:  # common random numbers across this run's evaluations (see EvalConfig.seed)
        for t in episodes.tasks:
            t.sampling_seed = mix_seed(cfg.eval.seed, split, t.meta["task"], t.meta["sample"])
    log.info("eval %s: %d episodes at policy version %s", split or "train_tasks", len(episodes.tasks),
             getattr(policy, "policy_version", "-"))  # greppable, and the moment an evaluation is under way
    t0 = time.perf_counter()
    trajs = _play(cfg, policy, episodes, progress)
    m = batch_metrics(trajs)
    m.pop("tokens", None)
    # which weights played: the versions every sampled token carries (one, when the policy was up to date)
    by_type: dict[str, int] = {}
    by_task: dict[str, list[int]] = {}
    for t in trajs:
        if t.task_type:
            by_type[str(t.task_type)] = by_type.get(str(t.task_type), 0) + 1
        if "task" in t.meta:
            counts = by_task.setdefault(str(t.meta["task"]), [0, 0])
            counts[0] += bool(t.success)
            counts[1] += 1
    m.update(episodes=len(trajs), successes=sum(bool(t.success) for t in trajs), wall_s=time.perf_counter() - t0,
             episodes_by_type=dict(sorted(by_type.items())),
             task_successes=dict(sorted(by_task.items(), key=lambda kv: int(kv[0]))),
             policy_versions=sorted({v for t in trajs for v in t.versions}))
    return m


def _play(cfg: RunConfig, policy, episodes: EpisodeSet, progress: bool) -> list:
    """Every task's episodes, on ``eval.samplers`` copies of the policy at once (one thread each)."""

    def play(p, shard: EpisodeSet, **kw) -> list:
        return shard.play(p, concurrency=min(16, len(shard.tasks)), **kw)

    tasks = episodes.tasks
    if hasattr(policy, "play_episodes"):  # the run's rollout samplers (Ray actors' engines) play them where they are
        from dataclasses import replace

        return policy.play_episodes(episodes.make_env, tasks,
                                    replace(episodes.rollout, concurrency=min(16, max(1, len(tasks)))))
    k = min(cfg.eval.samplers, len(tasks))
    if k <= 1:
        return play(policy, episodes, progress=progress)
    import torch

    if not hasattr(policy, "replica"):
        raise TypeError(f"eval.samplers={cfg.eval.samplers}: {type(policy).__name__} cannot be copied (only the "
                        "transformers sampler can); set eval.samplers=1")
    samplers = [policy] + [policy.replica(i) for i in range(1, k)]
    bar, lock = None, threading.Lock()
    if progress:  # one bar for all copies (run_episodes' own would draw one each)
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc="episodes", unit="ep", dynamic_ncols=True)

    def done(traj) -> None:
        if bar is not None:
            with lock:
                bar.update(1)

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // k))  # each copy's ops on its own share of the cores
    try:
        with ThreadPoolExecutor(k, thread_name_prefix="agentenv-eval-sampler") as pool:
            futures = [pool.submit(play, p, episodes.shard(i, k), on_trajectory=done) for i, p in enumerate(samplers)]
            return [t for f in futures for t in f.result()]
    finally:
        torch.set_num_threads(threads)
        if bar is not None:
            bar.close()
