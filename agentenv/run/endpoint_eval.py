"""``agentenv eval --endpoint URL --model NAME``: play an env against a served model and measure its tool use.

Contract of :func:`cmd_eval_endpoint`:

* The env, its tasks, the turn limit and the eval sampling settings come from the env's preset exactly as for a
  local ``agentenv eval`` (:mod:`agentenv.run.episodes`; ``--preset`` / ``--set`` change them). ``--model`` is the name
  the server serves, not a checkpoint. Every split in ``eval.splits`` (else the training tasks) is played:
  ``--episodes N`` episodes, dealt over the split's tasks in order and round after round (default: every task
  ``eval.samples`` times).
* The policy is :class:`agentenv.samplers.endpoint.EndpointPolicy` (text level, evaluation only), ``--concurrency`` episodes
  in flight on the runtime's threads. Its pre-flight runs before anything is written: an unreachable endpoint, a
  bad key, an unknown model or a request the server refuses is one ``error: ...`` line, exit 2, and no run
  directory.
* Output: ``RUN/config.yaml``, ``RUN/eval.jsonl`` (one trajectory per line as each episode ends, with its
  ``messages``; ``meta.split`` names the split) and ``RUN/summary.json`` (per split: the same metrics a local
  evaluation reports -- success, tool-call rate, per-tool call / error counts, turns -- plus the endpoint's request,
  retry and token counts); one ``[eval endpoint ...]`` line per split on stdout.
* A refusal in the middle of the run stops it (the remaining episodes fail at once): what was collected is kept,
  the error is printed and the exit code is 2. Episodes that failed for other reasons (retries exhausted) are
  counted in ``errors`` and kept in ``eval.jsonl`` with their ``error``; if every episode failed, exit 1.
"""

from __future__ import annotations

import json
import sys
import time

# metrics of token-level sampling: always 0 for a text policy, so not reported
_TOKEN_METRICS = ("policy_tokens_mean", "tokens_mean", "tokens", "template_error_rate")


def add_endpoint_args(p) -> None:
    g = p.add_argument_group("served model (OpenAI-compatible endpoint; evaluation only)")
    g.add_argument("--endpoint", default=None, metavar="URL", help="chat-completions root, e.g. http://127.0.0.1:8000/v1 "
                   "(a bare host:port gets /v1); --model is then the served model name")
    g.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key")
    g.add_argument("--episodes", type=int, default=None, help="episodes per split (default: every task eval.samples times)")
    g.add_argument("--concurrency", type=int, default=None, help="episodes in flight (default 8)")
    g.add_argument("--retries", type=int, default=None, help="retries per request on connection errors, timeouts, "
                   "429 and 5xx, with exponential backoff (default 3)")
    g.add_argument("--timeout", type=float, default=None, help="seconds per request (default 120)")


ENDPOINT_ONLY = ("api_key_env", "episodes", "concurrency", "retries", "timeout")
DEFAULTS = {"concurrency": 8, "retries": 3, "timeout": 120.0}


def endpoint_only_flags(args) -> list[str]:
    """The endpoint flags given without ``--endpoint`` (a local evaluation would ignore them)."""
    return ["--" + k.replace("_", "-") for k in ENDPOINT_ONLY if getattr(args, k, None) is not None]


def _tasks(cfg, split, episodes: int | None) -> list:
    from agentenv.run.episodes import task_list

    if episodes is None:
        return task_list(cfg, split, samples=cfg.eval.samples_for(split))
    one_round = task_list(cfg, split, samples=1)
    rounds = -(-episodes // max(1, len(one_round)))
    tasks = task_list(cfg, split, samples=rounds)
    tasks.sort(key=lambda t: (t.meta["sample"], t.meta["task"]))  # round after round over the tasks
    return tasks[:episodes]


def _first_prompt(cfg, split, task) -> tuple[list[dict], list[dict] | None]:
    from agentenv.run.episodes import env_factory

    env = env_factory(cfg, split)()
    try:
        obs, info = env.reset(seed=task.seed, options=task.options)
    finally:
        env.close()
    system = [{"role": "system", "content": info["system"]}] if info.get("system") else []
    return system + [{"role": "user", "content": obs}], info.get("tools") or None


def cmd_eval_endpoint(args, config_from_args) -> int:
    """``config_from_args(args)`` builds the RunConfig as every training command does (passed in: the CLI imports
    this module)."""
    from agentenv.core.config import ConfigError
    from agentenv.samplers.endpoint import EndpointError, EndpointPolicy, api_key_from_env
    from agentenv.run.episodes import rollout_config
    from agentenv.run.train import make_run_dir

    if not args.endpoint:
        print(f"error: {', '.join(endpoint_only_flags(args))} apply to --endpoint URL only (a local model's "
              "evaluation: --set eval.episodes=N)", file=sys.stderr)
        return 2
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.episodes is not None and args.episodes < 1 or args.concurrency < 1 or args.retries < 0 \
            or args.timeout <= 0:
        print("error: --episodes and --concurrency must be >= 1, --retries >= 0 and --timeout > 0", file=sys.stderr)
        return 2
    served, args.model = args.model, None  # the served name is not a model agentenv loads
    try:
        cfg = config_from_args(args)
        splits = cfg.eval.splits or [None]
        plays = {s: _tasks(cfg, s, args.episodes) for s in splits}
        sp = rollout_config(cfg, eval=True).sampling
        policy = EndpointPolicy(args.endpoint, served, api_key=api_key_from_env(args.api_key_env),
                                temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                                max_tokens=sp.max_new_tokens, timeout_s=args.timeout, retries=args.retries)
    except (ConfigError, EndpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        first_split = next(s for s in splits if plays[s])
        policy.check(*_first_prompt(cfg, first_split, plays[first_split][0]))
    except EndpointError as e:
        policy.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StopIteration:
        policy.close()
        print("error: the env has no tasks to play", file=sys.stderr)
        return 2

    cfg.model.name = served
    run_dir = make_run_dir(cfg)
    evals, failed, total = _play_splits(cfg, policy, served, plays, args, run_dir)
    summary = {"endpoint": policy.url, "model": served, "evals": evals, "requests": policy.requests,
               "retried_requests": policy.retried, "usage": policy.usage,
               "refused": str(policy.refused) if policy.refused else None}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"-> {run_dir / 'eval.jsonl'}, {run_dir / 'summary.json'}")
    if policy.refused is not None:
        print(f"error: {policy.refused}", file=sys.stderr)
        return 2
    if total and failed == total:
        print(f"error: every episode failed (see 'error' in {run_dir / 'eval.jsonl'})", file=sys.stderr)
        return 1
    return 0


def _play_splits(cfg, policy, served: str, plays: dict, args, run_dir) -> tuple[list[dict], int, int]:
    """Each split's tasks through the endpoint, written to ``RUN/eval.jsonl`` as they finish; one ``[eval ...]``
    line per split. Stops after the split where the endpoint refused. Returns (per-split metrics, failed, total)."""
    from agentenv.core.metrics import batch_metrics
    from agentenv.core.runtime import run_episodes
    from agentenv.core.trajectory import JsonlWriter
    from agentenv.run.episodes import env_factory, rollout_config

    evals, failed, total = [], 0, 0
    try:
        with JsonlWriter(run_dir / "eval.jsonl") as writer:
            for split in plays:
                for t in plays[split]:
                    t.meta["split"] = split or "train_tasks"
                t0 = time.perf_counter()
                trajs = run_episodes(env_factory(cfg, split), policy, len(plays[split]),
                                     rollout_config(cfg, eval=True, concurrency=args.concurrency),
                                     tasks=plays[split], progress=not args.no_progress, on_trajectory=writer.write)
                m = {k: v for k, v in batch_metrics(trajs).items() if k not in _TOKEN_METRICS}
                errors = sum(t.finish_reason in ("policy_error", "env_error") for t in trajs)
                failed, total = failed + errors, total + len(trajs)
                m.update(episodes=len(trajs), successes=sum(bool(t.success) for t in trajs), errors=errors,
                         wall_s=time.perf_counter() - t0)
                evals.append({"split": split or "train_tasks", **m})
                print(f"[eval endpoint={policy.url} model={served} split={split or 'train_tasks'}] " + " ".join(
                    f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items()))
                if policy.refused is not None:
                    break
    finally:
        policy.close()
    return evals, failed, total
