"""The ``agentenv`` command line (also ``python -m agentenv.cli``).

Subcommands are added by small ``add_*`` functions, one per area, so each stays next to the code it drives.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def _add_rollout(sub) -> None:
    p = sub.add_parser("rollout", help="run N episodes of a policy in an env and write trajectories to JSONL",
                       description="Run episodes and write one trajectory per line (see agentenv.trajectory).")
    p.add_argument("--env", required=True, help="env alias (guess, python, alfworld) or gymnasium id agentenv/...")
    p.add_argument("--model", default="tiny", help="'tiny', 'expert', a local checkpoint dir, or an alias like qwen2.5-7b")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--out", default="rollouts.jsonl", help="output JSONL path")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off (passed explicitly; no library default applies)")
    p.add_argument("--max-turns", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=256, help="per assistant turn")
    p.add_argument("--max-total-tokens", type=int, default=4096, help="whole trajectory")
    p.add_argument("--concurrency", type=int, default=8, help="episodes in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default=None, help="dataset split for envs that have one (alfworld: train, valid_seen, valid_unseen)")
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
    if backend == "vllm":
        from agentenv.models import resolve_model
        from agentenv.vllm_policy import VLLMPolicy

        rm = resolve_model(model)
        return VLLMPolicy(rm.path, name=rm.name, seed=seed)
    from agentenv.models import load_hf_policy

    return load_hf_policy(model, seed=seed)


def cmd_rollout(args) -> int:
    import gymnasium as gym

    import agentenv  # noqa: F401  (registers envs)
    from agentenv.envs import resolve_env_id
    from agentenv.models import ModelNotAvailable
    from agentenv.policy import SamplingParams
    from agentenv.runtime import RolloutConfig, run_episodes, summarize
    from agentenv.trajectory import JsonlWriter

    env_id = resolve_env_id(args.env)
    env_kwargs = parse_kv(args.env_arg)
    if args.split is not None:
        env_kwargs["split"] = args.split
    try:
        policy = build_policy(args.model, env_id, seed=args.seed, backend=args.backend)
    except ModelNotAvailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = RolloutConfig(max_turns=args.max_turns, max_total_tokens=args.max_total_tokens, concurrency=args.concurrency,
                        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                                max_new_tokens=args.max_new_tokens))
    t0 = time.perf_counter()
    with JsonlWriter(args.out) as writer:
        trajs = run_episodes(lambda: gym.make(env_id, **env_kwargs), policy, args.episodes, cfg, seed=args.seed,
                             progress=True, on_trajectory=writer.write)
    s = summarize(trajs, time.perf_counter() - t0)
    print(f"episodes={s['episodes']} success={s['success_rate']:.3f} mean_turns={s['mean_turns']:.2f} "
          f"tool_calls/ep={s['tool_calls_per_episode']:.2f} tokens={s['tokens']} truncation={s['truncation_rate']:.3f} "
          f"errors={s['errors']} wall={s['wall_time_s']:.1f}s -> {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentenv", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_rollout(sub)
    try:
        from agentenv.sandboxes.cli import add_subcommands as add_sandbox
    except ImportError:  # pragma: no cover - sandboxes are part of the package
        add_sandbox = None
    if add_sandbox is not None:
        add_sandbox(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
