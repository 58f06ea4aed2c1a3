"""``agentenv rollout``: play N episodes of a policy (a sampler, or an env's scripted expert) in an env and write one
trajectory per line (:mod:`agentenv.core.trajectory`), through the one episode path (:class:`EpisodeSet`).

Like :mod:`agentenv.sandboxes.cli`, this module adds its own subcommand to the ``agentenv`` parser
(:func:`add_subcommand`); :func:`cmd_rollout` prints one summary line and returns the exit code (2: an unknown env
or an unavailable model, with the reason).
"""

from __future__ import annotations

import json
import sys
import time


def add_subcommand(sub) -> None:
    p = sub.add_parser("rollout", help="run N episodes of a policy in an env and write trajectories to JSONL",
                       description="Run episodes and write one trajectory per line (see agentenv.core.trajectory).")
    p.add_argument("--env", required=True, help="env alias (guess, python, alfworld), gymnasium id, or MODULE:ENV_ID")
    p.add_argument("--model", default="tiny", help="'tiny', 'expert', a local checkpoint dir, or an alias like qwen2.5-7b")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--out", default="rollouts.jsonl", help="output JSONL path")
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
    """'expert' -> the env's scripted expert; anything else -> a sampler over a resolved checkpoint."""
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


def cmd_rollout(args) -> int:
    import math

    import gymnasium as gym

    import agentenv  # noqa: F401  (registers envs)
    from agentenv.envs import spec
    from agentenv.core.metrics import batch_metrics
    from agentenv.samplers.models import ModelNotAvailable
    from agentenv.core.policy import SamplingParams
    from agentenv.core.runtime import EpisodeSpec, RolloutConfig
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
    except ModelNotAvailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env_kwargs = {**getattr(policy, "env_kwargs", {}), **env_kwargs}  # e.g. the ALFWorld expert needs expert=True
    from agentenv.run.startup import build_env

    problem, _ = build_env(env_id, env_kwargs, shown="--env-arg " + " ".join(args.env_arg) if args.env_arg else "")
    if problem:  # before --out is opened: a wrong --env-arg leaves no file behind
        print(f"error: {problem}", file=sys.stderr)
        return 2
    tasks = [EpisodeSpec(seed=args.seed + i) for i in range(args.episodes)]
    if args.split is not None:  # walk the split's tasks in order, k = ceil(episodes / tasks) samples each
        env = gym.make(env_id, **env_kwargs)
        try:
            options = spec.task_options(env) or []
        finally:
            env.close()
        k = math.ceil(args.episodes / max(1, len(options)))
        tasks = [EpisodeSpec(seed=args.seed + i, options=dict(o), meta={"sample": j})
                 for i, o in enumerate(options) for j in range(k)][: args.episodes] or tasks
    cfg = RolloutConfig(max_turns=args.max_turns or 1_000_000, max_total_tokens=args.max_total_tokens, concurrency=args.concurrency,
                        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                                max_new_tokens=args.max_new_tokens))
    from agentenv.run.episodes import EpisodeSet
    from agentenv.trainer.backends import GymEnvFactory

    episodes = EpisodeSet(GymEnvFactory(env_id, env_kwargs), tasks, cfg)
    t0 = time.perf_counter()
    with JsonlWriter(args.out) as writer:
        trajs = episodes.play(policy, progress=sys.stderr.isatty(), on_trajectory=writer.write)
    m = batch_metrics(trajs)
    errors = sum(t.finish_reason in ("env_error", "policy_error", "template_error") for t in trajs)
    print(f"episodes={len(trajs)} success={m['success_rate']:.3f} turns={m['turns_mean']:.2f} "
          f"tool_call_rate={m['tool_call_rate']:.2f} tool_calls={m['tool_calls_mean']:.2f} "
          f"tool_malformed={m['tool_malformed_mean']:.2f} tokens={m['tokens']} truncation={m['truncation_rate']:.3f} "
          f"errors={errors} wall={time.perf_counter() - t0:.1f}s -> {args.out}")
    return 0
