"""``agentenv rollout``: play N episodes of a policy (a sampler, an env's scripted expert, or the user's own function
``--model MODULE:CALLABLE``) in an env and write one trajectory per line (:mod:`agentenv.core.trajectory`), through
the one episode path (:class:`EpisodeSet`).

* ``--model MODULE:CALLABLE``: a :class:`agentenv.samplers.scripted.ScriptedPolicy` over the user's function
  (OpenAI chat messages -> the next assistant message), checked on the env's first prompt before anything is
  written.
* ``--demos FILE``: also write each episode as a demo line for ``agentenv sft --env ENV --demos FILE``
  (:func:`agentenv.run.env_demos.demo_from_trajectory`). The episodes then deal the env's tasks round after round
  (episode k plays ``task_index`` k mod the number of tasks; with ``--split``, the split's order), so each demo
  names its task; an env without a task list is refused.

Like :mod:`agentenv.sandboxes.cli`, this module adds its own subcommand to the ``agentenv`` parser
(:func:`add_subcommand`); :func:`cmd_rollout` prints one summary line and returns the exit code (2: an unknown env,
an unavailable model or a bad ``MODULE:CALLABLE``, with the reason, before any file is written).
"""

from __future__ import annotations

import json
import sys
import time


def add_subcommand(sub) -> None:
    p = sub.add_parser("rollout", help="run N episodes of a policy in an env and write trajectories to JSONL",
                       description="Run episodes and write one trajectory per line (see agentenv.core.trajectory).")
    p.add_argument("--env", required=True, help="env alias (guess, python, alfworld), gymnasium id, or MODULE:ENV_ID")
    p.add_argument("--model", default="tiny", help="'tiny', 'expert', a local checkpoint dir, an alias like qwen2.5-7b, "
                   "or MODULE:CALLABLE, your function from the chat so far (OpenAI messages) to the next assistant "
                   "message (MODULE importable from here, or path/to/file.py)")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--out", default="rollouts.jsonl", help="output JSONL path")
    p.add_argument("--demos", default=None, metavar="FILE", help="also write each episode as a demo line for "
                   "`agentenv sft --env ENV --demos FILE`; episodes then deal the env's tasks in order")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off (passed explicitly; no library default applies)")
    p.add_argument("--max-turns", type=int, default=None,
                   help="runtime turn limit (default: none of its own; the env's limit applies, e.g. ALFWorld's 50)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per assistant turn")
    p.add_argument("--max-total-tokens", type=int, default=4096, help="whole trajectory")
    p.add_argument("--concurrency", type=int, default=8, help="episodes in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default=None, help="dataset split for envs that have one (alfworld: train, valid_seen, "
                   "valid_unseen); episodes then walk the split's games in order (k = ceil(episodes / games) each)")
    p.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra keyword argument for the env constructor (JSON values allowed); repeatable")
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf", help="sampler backend for LLM policies")
    p.set_defaults(func=cmd_rollout)


def parse_kv(items: list[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise SystemExit(f"expected KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


def build_policy(model: str, env_id: str, *, seed: int = 0, backend: str = "hf"):
    """'expert' -> the env's scripted expert; MODULE:CALLABLE -> the user's function as a policy; anything else ->
    a sampler over a resolved checkpoint."""
    from agentenv.samplers.scripted import is_scripted, load_scripted

    if is_scripted(model):
        return load_scripted(model)
    if model == "expert":
        import importlib

        from agentenv.envs import EXPERTS

        if env_id not in EXPERTS:
            raise SystemExit(f"environment {env_id} has no scripted expert; experts exist for: {', '.join(EXPERTS)}")
        module, factory = EXPERTS[env_id].split(":")
        return getattr(importlib.import_module(module), factory)()
    from agentenv.samplers.factory import sampler_factory

    if backend == "vllm":  # one engine in this process, with vLLM's own default memory share
        return sampler_factory(model, "vllm", seed=seed, gpu_memory_utilization=0.9)(0)
    return sampler_factory(model, "hf", seed=seed)(0)


def _episodes(args, env_id: str, env_kwargs: dict, policy) -> tuple[list, str | None]:
    """The episodes to play (see the module docstring) -> (EpisodeSpecs, a one-line problem or None). A scripted
    policy answers the first episode's prompt here, so that a bad reply stops the rollout before any file is made."""
    import math

    import gymnasium as gym

    from agentenv.core.runtime import EpisodeSpec
    from agentenv.envs import spec

    tasks = [EpisodeSpec(seed=args.seed + i) for i in range(args.episodes)]
    env = gym.make(env_id, **env_kwargs)
    try:
        options = (spec.task_options(env) or []) if args.split is not None or args.demos else []
        if args.split is not None:  # walk the split's tasks in order, k = ceil(episodes / tasks) samples each
            k = math.ceil(args.episodes / max(1, len(options)))
            tasks = [EpisodeSpec(seed=args.seed + i, options=dict(o), meta={"sample": j})
                     for i, o in enumerate(options) for j in range(k)][: args.episodes] or tasks
        elif args.demos:  # deal the tasks round after round
            tasks = [EpisodeSpec(seed=args.seed + e, options=dict(options[e % len(options)]), meta={"sample": e // len(options)})
                     for e in range(args.episodes)] if options else tasks
        if args.demos and not all(t.options and "task_index" in t.options for t in tasks):
            return [], (f"--demos: {env_id} has no task list (reset option task_index), so a demo cannot name its "
                        "task; write trajectories only (drop --demos)")
        for t in tasks:
            if t.options and "task_index" in t.options:
                t.meta["task_index"] = t.options["task_index"]
        if hasattr(policy, "check") and hasattr(policy, "fn"):  # a scripted policy: its first reply, checked
            obs, info = env.reset(seed=tasks[0].seed, options=tasks[0].options)
            policy.check(([{"role": "system", "content": info["system"]}] if info.get("system") else [])
                         + [{"role": "user", "content": obs}])
    finally:
        env.close()
    return tasks, None


def cmd_rollout(args) -> int:
    import agentenv  # noqa: F401  (registers envs)
    from agentenv.envs import spec
    from agentenv.core.metrics import batch_metrics
    from agentenv.samplers.models import ModelNotAvailable
    from agentenv.samplers.scripted import ScriptError
    from agentenv.core.policy import SamplingParams
    from agentenv.core.runtime import RolloutConfig
    from agentenv.core.trajectory import JsonlWriter

    try:
        env_id = spec.resolve(args.env)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env_kwargs = parse_kv(args.env_arg)
    if args.split is not None:
        env_kwargs["split"] = args.split
    try:
        policy = build_policy(args.model, env_id, seed=args.seed, backend=args.backend)
    except (ModelNotAvailable, ScriptError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env_kwargs = {**getattr(policy, "env_kwargs", {}), **env_kwargs}  # e.g. the ALFWorld expert needs expert=True
    from agentenv.run.startup import build_env

    problem, _ = build_env(env_id, env_kwargs, shown="--env-arg " + " ".join(args.env_arg) if args.env_arg else "")
    if problem is None:  # before --out is opened: a wrong --env-arg or a bad scripted reply leaves no file behind
        try:
            tasks, problem = _episodes(args, env_id, env_kwargs, policy)
        except ScriptError as e:
            problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    cfg = RolloutConfig(max_turns=args.max_turns or 1_000_000, max_total_tokens=args.max_total_tokens, concurrency=args.concurrency,
                        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                                max_new_tokens=args.max_new_tokens))
    from agentenv.run.episodes import EpisodeSet
    from agentenv.trainer.backends import GymEnvFactory

    episodes = EpisodeSet(GymEnvFactory(env_id, env_kwargs), tasks, cfg)
    t0 = time.perf_counter()
    with JsonlWriter(args.out) as writer, _DemoWriter(args.demos) as demos:
        trajs = episodes.play(policy, progress=sys.stderr.isatty(), on_trajectory=lambda t: (writer.write(t), demos.write(t)))
    m = batch_metrics(trajs)
    errors = [t for t in trajs if t.finish_reason in ("env_error", "policy_error", "template_error")]
    print(f"episodes={len(trajs)} success={m['success_rate']:.3f} turns={m['turns_mean']:.2f} "
          f"tool_call_rate={m['tool_call_rate']:.2f} tool_calls={m['tool_calls_mean']:.2f} "
          f"tool_malformed={m['tool_malformed_mean']:.2f} tokens={m['tokens']} truncation={m['truncation_rate']:.3f} "
          f"errors={len(errors)} wall={time.perf_counter() - t0:.1f}s -> {args.out}" + demos.summary())
    if errors:
        print(f"warning: {len(errors)} episodes ended in {errors[0].finish_reason}; the first: {errors[0].error}",
              file=sys.stderr)
    return 0


class _DemoWriter:
    """``--demos FILE``: one demo line per episode that can be one (see :mod:`agentenv.run.env_demos`)."""

    def __init__(self, path: str | None):
        self.path, self.f, self.written, self.skipped = path, None, 0, 0

    def __enter__(self):
        self.f = open(self.path, "w", encoding="utf-8") if self.path else None
        return self

    def write(self, traj) -> None:
        if self.f is None:
            return
        from agentenv.run.env_demos import demo_from_trajectory

        demo = demo_from_trajectory(traj, traj.meta["task_index"])
        if demo is None:
            self.skipped += 1
            return
        self.f.write(json.dumps(demo) + "\n")
        self.f.flush()
        self.written += 1

    def __exit__(self, *exc):
        if self.f is not None:
            self.f.close()

    def summary(self) -> str:
        return f"; demos={self.written} (skipped {self.skipped}) -> {self.path}" if self.path else ""
