"""What the episodes of a run are: the env to build, its tasks, and the runtime settings -- and the one way to play
them.

:class:`EpisodeSet` (env factory, task list, rollout settings) is what training hands the loop, what evaluation plays
on the eval split, what ``agentenv rollout`` plays from its flags and what the SFT warm start's expert plays:
``EpisodeSet.of(cfg, split)`` from a RunConfig, or the constructor from parts; ``play(policy)`` runs every task once
through :func:`agentenv.core.runtime.run_episodes`. It is built from one function each:

* :func:`env_factory(cfg, split)` -> a picklable ``make_env`` (gymnasium id + constructor kwargs; the turn limit and
  split come from the config through :func:`agentenv.envs.spec.make_kwargs`; ``env.tasks: demo`` adds the CPU demo's
  task set, with ``env.demo_easy_fraction`` of easy questions).
* :func:`task_list(cfg, split, limit, samples)` -> runtime :class:`~agentenv.core.runtime.EpisodeSpec` objects: one per task the
  env declares (:func:`agentenv.envs.spec.task_options`), or seeds ``0..env.num_tasks-1`` for an env without a task
  list. For training, an env with more tasks than ``env.num_tasks`` contributes a seeded subset of that size.
* :func:`rollout_config(cfg, eval=...)` -> the runtime's :class:`~agentenv.core.runtime.RolloutConfig` (the ONE converter
  from the ``rollout`` section; evaluation swaps in ``eval.temperature`` / ``eval.top_p`` when set).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from agentenv.core.config import RunConfig
from agentenv.core.runtime import EpisodeSpec, RolloutConfig, run_episodes
from agentenv.core.trajectory import Trajectory
from agentenv.envs import spec


@dataclass
class EpisodeSet:
    """Episodes to play: ``make_env`` (picklable: Ray actors build their envs from it), one :class:`EpisodeSpec` per
    episode, and the runtime settings (turn limit, token budgets, sampling, concurrency)."""

    make_env: Callable
    tasks: list[EpisodeSpec]
    rollout: RolloutConfig

    @classmethod
    def of(cls, cfg: RunConfig, split: str | None = None, *, eval: bool = False, limit: int | None = None,
           samples: int = 1) -> "EpisodeSet":
        """The run's episodes on ``split`` (None: the training tasks) with the ``rollout`` (or, ``eval``, the
        evaluation) sampling settings."""
        return cls(env_factory(cfg, split), task_list(cfg, split, limit=limit, samples=samples),
                   rollout_config(cfg, eval=eval))

    def shard(self, i: int, k: int) -> "EpisodeSet":
        """Every ``k``-th task from ``i``: one of ``k`` samplers' share."""
        return replace(self, tasks=self.tasks[i::k])

    def for_policy(self, policy) -> "EpisodeSet":
        """The same episodes in envs built with what ``policy`` needs of them (its ``env_kwargs``, e.g. the ALFWorld
        expert's ``expert=True``); unchanged for a policy that needs nothing."""
        extra = getattr(policy, "env_kwargs", None)
        if not extra:
            return self
        return replace(self, make_env=replace(self.make_env, kwargs={**self.make_env.kwargs, **extra}))

    def play(self, policy, *, concurrency: int | None = None, progress: bool = False,
             on_trajectory: Callable[[Trajectory], None] | None = None) -> list[Trajectory]:
        """Every episode once, ``concurrency`` (default: the rollout's) at a time; trajectories in completion order."""
        rollout = self.rollout if concurrency is None else replace(self.rollout, concurrency=concurrency)
        return run_episodes(self.make_env, policy, len(self.tasks), rollout, tasks=self.tasks, progress=progress,
                            on_trajectory=on_trajectory)


def env_kwargs(cfg: RunConfig, split: str | None = None) -> dict:
    env_id = spec.resolve(cfg.env.id)
    kw = dict(cfg.env.kwargs)
    if cfg.env.tasks == "demo":  # the demo's split picks its task set (demo.is_heldout); the env itself has none
        from agentenv.run import demo

        easy = cfg.env.demo_easy_fraction
        tasks = (demo.demo_tasks(cfg.env.num_tasks, seed=cfg.loop.seed, easy_fraction=easy)
                 if split in (None, "train") else
                 demo.demo_tasks(cfg.eval.episodes or cfg.env.num_tasks, seed=demo.HELDOUT_SEED, split=split,
                                 easy_fraction=easy))
        kw.setdefault("tasks", [t.__dict__ for t in tasks])
        kw.setdefault("system_prompt", demo.SYSTEM_PROMPT)
        kw.setdefault("tool_doc", demo.TOOL_DOC)
        split = None
    split = split if split is not None else (cfg.env.train_split if spec.takes(env_id, "split") else None)
    return spec.make_kwargs(env_id, kw, max_turns=cfg.rollout.max_turns, split=split)


def env_factory(cfg: RunConfig, split: str | None = None):
    from agentenv.trainer.backends import GymEnvFactory

    env_id = spec.resolve(cfg.env.id)
    if ":" in cfg.env.id:  # keep gymnasium's module:EnvId form: a fresh process (a Ray actor) imports the module too
        env_id = f"{cfg.env.id.split(':', 1)[0]}:{env_id}"
    return GymEnvFactory(env_id, env_kwargs(cfg, split))


def task_list(cfg: RunConfig, split: str | None = None, *, limit: int | None = None, samples: int = 1) -> list:
    env = env_factory(cfg, split)()
    try:
        options = spec.task_options(env)
    finally:
        env.close()
    n = len(options) if options else cfg.env.num_tasks
    index = list(range(n))
    if split is None and n > cfg.env.num_tasks:  # training on a seeded subset (e.g. ALFWorld's 1,024 games)
        index = sorted(np.random.default_rng(cfg.loop.seed).choice(n, cfg.env.num_tasks, replace=False).tolist())
    if limit is not None:
        index = index[:limit]
    return [EpisodeSpec(seed=i, options=dict(options[i]) if options else None, meta={"task": i, "sample": s})
            for i in index for s in range(samples)]


def rollout_config(cfg: RunConfig, *, eval: bool = False, concurrency: int = 8) -> RolloutConfig:
    from agentenv.core.policy import SamplingParams

    r = cfg.rollout
    temperature = (cfg.eval.temperature if eval and cfg.eval.temperature else None) or r.temperature
    top_p = (cfg.eval.top_p if eval and cfg.eval.top_p else None) or r.top_p
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens)
    kw = {}
    if r.max_generated_tokens is not None:
        kw["max_generated_tokens"] = r.max_generated_tokens
    return RolloutConfig(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, sampling=sampling,
                         concurrency=concurrency, return_entropy=False, **kw)
