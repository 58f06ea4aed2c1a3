"""``agentenv run``: execute the launch plan of a :class:`~agentenv.core.config.RunConfig`.

Contract of :func:`run(cfg)` (a :class:`Run`: ``prepare`` is 1-2, ``train`` 3-5, ``finish`` the summary and plot):

1. The plan (:func:`agentenv.run.plan.launch_plan`) is computed once; any reason it cannot start stops the run before
   anything heavy (:class:`~agentenv.run.plan.LaunchError`, with the fix). It is saved as ``RUN/plan.json`` next to the
   resolved ``RUN/config.yaml``.
2. Optional SFT warm start (``sft.enabled``) into ``RUN/sft_model``.
3. The parts the plan names are built -- samplers (:func:`policy_factory`: transformers or vLLM), the learner
   (:func:`agentenv.trainer.distributed.make_learner`: one process, or FSDP2 ranks: processes, or Ray actors placed
   with the engines by :mod:`agentenv.trainer.placement`) -- and wired by
   :class:`agentenv.trainer.loop.Trainer`; every update goes to ``RUN/metrics.jsonl`` / TensorBoard / one
   ``[update N]`` line (:class:`agentenv.core.metrics.MetricsLogger`), every trajectory to ``RUN/trajectories.jsonl``.
4. Evaluation (:mod:`agentenv.run.evaluation`) at the start, every ``eval.every`` updates and at the end, always with the
   learner's CURRENT weights, on the run's own rollout samplers whatever the backend (never an engine of its own).
5. ``algo.average_last_updates`` = N > 0: when the loop finishes (not on Ctrl-C), the learner's weights become the
   mean of its weights after each of the last N updates (:meth:`Learner.use_average`); the final evaluation (its
   records carry ``weights``) and ``RUN/final_model`` are of that mean, checkpoints of the weights rollouts used.
   The trained policy is saved as a Hugging Face model directory in ``model.save_dtype`` (default the compute
   dtype): ``RUN/final_model`` and, at ``loop.checkpoint_every``, ``RUN/checkpoints/step_N/model`` (the newest
   ``loop.keep_checkpoints`` kept). ``RUN/summary.json`` records the loop's summary,
   the evaluations and ``components``: what actually started (it equals the plan's).
6. ``resume=True`` continues ``RUN`` from its latest checkpoint (``agentenv run --resume RUN``).
Ctrl-C: the loop finishes the update in flight, checkpoints and shuts down; the end-of-run outputs still appear.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.core.config import FlashReinforceLoss, RunConfig
from agentenv.run.plan import LaunchError, LaunchPlan, launch_plan, preflight, print_plan

log = logging.getLogger("agentenv.run.train")

__all__ = ["LaunchError", "Run", "RunResult", "dry_run", "policy_factory", "run"]


def dry_run(cfg: RunConfig, out=print) -> int:
    return print_plan(cfg, launch_plan(cfg), out)


def policy_factory(cfg: RunConfig, model_path: str, plan: LaunchPlan):
    """A picklable ``make_policy(worker_index)`` for the sampler the plan names (weights in the compute dtype)."""
    from agentenv.samplers.factory import sampler_factory

    dtype = plan.components.learner.compute_dtype
    if plan.components.sampler == "vllm":
        return sampler_factory(model_path, "vllm", seed=cfg.loop.seed, dtype=dtype,
                               gpu_memory_utilization=cfg.launch.vllm_gpu_memory_utilization,
                               tensor_parallel=cfg.launch.vllm_tensor_parallel,
                               enable_sleep_mode=plan.sleep_samplers_during_update,
                               max_model_len=cfg.rollout.max_total_tokens, colocated=plan.colocated,
                               weight_transfer=cfg.launch.weight_transfer if cfg.loop.backend == "ray" else None)
    return sampler_factory(model_path, "hf", seed=cfg.loop.seed, device=plan.device,
                           dtype=dtype if plan.device.startswith("cuda") else "float32")


def make_run_dir(cfg: RunConfig) -> Path:
    d = Path(cfg.run.dir) if cfg.run.dir else Path("runs") / f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(cfg.to_yaml())
    return d


@dataclass
class RunResult:
    run_dir: Path
    summary: dict
    history: list
    evals: list


def run(cfg: RunConfig, *, eval_only: bool = False, resume: bool = False, progress: bool = True,
        echo=print) -> RunResult:
    """Execute ``cfg``'s launch plan (the module docstring): a :class:`Run`'s prepare, then train and finish."""
    r = Run(cfg, resume=resume, progress=progress, echo=echo)
    r.prepare(eval_only=eval_only)
    if eval_only:
        return r.evaluate_only()
    try:
        summary = r.train()
    finally:
        r.close()
    return r.finish(summary)


class Run:
    """One training run: :meth:`prepare` (plan, run dir, warm start, logger, sampler factory), :meth:`train` (the
    learner and the loop, evaluations on its updates, the final weights) and :meth:`finish` (summary, plot)."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, progress: bool = True, echo=print):
        self.cfg, self.resume, self.progress, self.echo = cfg, resume, progress, echo
        self.evals: list[dict] = []
        self.learner = self.trainer = self.bar = self.placement = None
        self.averaged, self.final_weights = 0, None  # the tail average the loop's end swapped in (``on_end``)

    def prepare(self, *, eval_only: bool = False) -> None:
        import torch

        from agentenv.core.metrics import MetricsLogger

        cfg = self.cfg
        self.plan = plan = launch_plan(cfg)
        preflight(plan)
        for note in plan.notes:
            log.warning("%s", note)
        if plan.context_tokens < cfg.rollout.max_total_tokens:  # the model's positions cap the context
            cfg = self.cfg = cfg.model_copy(deep=True)
            cfg.rollout.max_total_tokens = plan.context_tokens
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.run_dir = run_dir = make_run_dir(cfg)
        (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
        self.echo(f"run dir: {run_dir}  (config.yaml, plan.json saved)")
        self.t_start = time.perf_counter()
        self.model_path = plan.model.path
        if cfg.sft.enabled and not eval_only:  # warm start (a resumed run reuses it)
            sft_dir = run_dir / "sft_model"
            self.model_path = str(sft_dir if self.resume and (sft_dir / "config.json").exists()
                                  else warm_start(cfg, self.model_path, sft_dir, progress=self.progress, echo=self.echo))
        self.logger = MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                                    collapse_window=cfg.run.collapse_window, collapse_ratio=cfg.run.collapse_ratio,
                                    config=cfg.to_dict(), echo=self.echo,
                                    no_learning_updates=cfg.run.no_learning_updates)
        self.make_policy = policy_factory(cfg, self.model_path, plan)
        self.save_dtype = cfg.model.save_dtype or plan.components.learner.compute_dtype

    def evaluate(self, policy, step: int, weights: str | None = None) -> None:
        from agentenv.run.evaluation import evaluate

        for split in (self.cfg.eval.splits or [None]):
            m = evaluate(self.cfg, policy, split, progress=self.progress)
            if weights:
                m["weights"] = weights
            self.logger.log_eval(step, split or "train_tasks", m)
            self.evals.append({"update": step, "split": split or "train_tasks", **m})

    def evaluate_only(self) -> RunResult:
        self.evaluate(self.make_policy(0), 0)
        self.logger.close()
        summary = {"eval_only": True, "evals": self.evals,
                   "components": {"sampler": self.plan.components.sampler}}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return RunResult(self.run_dir, summary, [], self.evals)

    def current_weights_policy(self):
        """The rollout samplers, holding the learner's current weights: the local backend's own sampler, or the Ray
        actors' engines (evaluation never starts an engine of its own)."""
        learner = self.learner
        local = self.trainer.local_policy()  # None with Ray (samplers live in actors)
        if local is not None:
            if getattr(local, "policy_version", None) != learner.policy_version:  # the weight average swapped in
                local.load_weights(learner.export_weights(), learner.policy_version)
            return local
        return OnRolloutSamplers(self.trainer)

    def on_update(self, m: dict) -> None:
        cfg = self.cfg
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(success=f"{m.get('success_rate', 0):.2f}", tool=f"{m.get('tool_call_rate', 0):.2f}")
        step = int(m["update"])
        if cfg.eval.every and step % cfg.eval.every == 0:
            self.evaluate(self.current_weights_policy(), step)
        if cfg.loop.checkpoint_every and step % cfg.loop.checkpoint_every == 0:
            self.learner.save_pretrained(self.run_dir / "checkpoints" / f"step_{step}" / "model",
                                         source=self.model_path, dtype=self.save_dtype)
            prune_model_dirs(self.run_dir / "checkpoints", cfg.loop.keep_checkpoints)

    def train(self) -> dict:
        """The gate's lag-0 check, the learner the plan names, the loop; then the final weights, evaluated and
        saved. Returns the loop's summary."""
        from agentenv.run.episodes import EpisodeSet
        from agentenv.trainer.distributed import make_learner
        from agentenv.trainer.loop import Trainer

        cfg, plan = self.cfg, self.plan
        _check_truncated_sampling(cfg, self.model_path, plan.device)
        if cfg.loop.backend == "ray":  # Ray starts here: the learner ranks and the engines share its placement
            from agentenv.trainer.placement import make_placement

            self.placement = make_placement(cfg, plan)
        self.learner = make_learner(cfg, self.model_path, device=plan.device, placement=self.placement)
        episodes = EpisodeSet.of(cfg)
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.loop.total_updates, desc="updates", unit="upd", dynamic_ncols=True,
                            file=sys.stderr)
        self.trainer = trainer = Trainer(
            cfg.loop, rollout=episodes.rollout, launch=cfg.launch, make_env=episodes.make_env,
            make_policy=self.make_policy, learner=self.learner, tasks=episodes.tasks, run_dir=self.run_dir,
            resume=self.resume, metrics=self.logger, on_update=self.on_update,
            save_trajectories=cfg.run.save_trajectories,
            sleep_samplers_during_update=plan.sleep_samplers_during_update, placement=self.placement,
            on_start=self.on_start, on_end=self.on_end)
        try:
            with shared_cpu_threads(cfg.loop.mode == "async" and cfg.loop.backend == "local"
                                    and cfg.model.backend == "hf" and plan.device.startswith("cpu")):
                summary = trainer.run()
        finally:
            if self.bar is not None:
                self.bar.close()
        summary["averaged_updates"] = self.averaged
        summary["eval_s"] = sum(e.get("wall_s", 0.0) for e in self.evals)  # what evaluation cost the run
        self.final_model = self.run_dir / "final_model"
        self.learner.save_pretrained(self.final_model, source=self.model_path, dtype=self.save_dtype)
        self.echo(f"model: {self.final_model}  (a Hugging Face model directory: --model {self.final_model})")
        # asked now: a sharded learner's ranks are Ray actors that ``close`` ends
        self.learner_placement = getattr(self.learner, "placement", lambda: None)()
        self.learner_components = self.learner.components()
        return summary

    def on_start(self) -> None:
        """The samplers hold the first weights: evaluate the starting weights (kept for later evaluations)."""
        if self.cfg.eval.at_start and not self.resume:
            self.evaluate(self.current_weights_policy(), self.trainer.step)

    def on_end(self) -> None:
        """The loop finished (not Ctrl-C, which means "stop now": save, do not evaluate) with the samplers still
        up: swap in the tail average and evaluate it, unless ``eval.every`` just measured these weights."""
        cfg, trainer = self.cfg, self.trainer
        self.averaged = averaged = self.learner.use_average()
        if averaged > 1:
            self.final_weights = f"mean of the weights after updates {trainer.step - averaged + 1}-{trainer.step}"
            self.echo(f"final weights: the {self.final_weights} "
                      f"(algo.average_last_updates={cfg.algo.average_last_updates})")
        measured = bool(self.evals) and self.evals[-1]["update"] == trainer.step and not self.final_weights
        if cfg.eval.at_end and not measured:
            self.evaluate(self.current_weights_policy(), trainer.step, self.final_weights)

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()
        if self.placement is not None:
            self.placement.close()

    def finish(self, summary: dict) -> RunResult:
        """``RUN/summary.json`` (the whole run's step counts, a resumed run's included), the plot."""
        from agentenv.core.metrics import read_metrics
        from agentenv.core.stall import step_counts

        cfg, run_dir, logger, trainer = self.cfg, self.run_dir, self.logger, self.trainer
        logger.close()
        summary["wall_s"] = time.perf_counter() - self.t_start
        summary.update(step_counts(read_metrics(run_dir)))
        summary["no_learning_warning"] = logger.stall.warned
        components = {**trainer.components, "learner": self.learner_components}
        if "placement" in components:  # where Ray put the learner ranks (None: the learner ran in this process)
            components["placement"] = {"learner": self.learner_placement or [], **components["placement"]}
        (run_dir / "summary.json").write_text(json.dumps({"summary": summary, "components": components,
                                                          "evals": self.evals, "final_model": str(self.final_model)},
                                                         indent=2, default=str))
        if cfg.run.plot and logger.history and not trainer.interrupted:
            from agentenv.run.plot import plot_runs

            png = plot_runs([run_dir], title=f"{cfg.run.name} {' '.join(cfg.variants)} ({cfg.model.name})")
            self.echo(f"plot: {png}")
        self.echo(f"done: {trainer.step} updates in {summary['wall_s']:.0f}s -> {run_dir}")
        return RunResult(run_dir, {**summary, "components": components}, logger.history, self.evals)


@contextlib.contextmanager
def shared_cpu_threads(shared: bool):
    """While the learner and local samplers compute at once on the CPU (``shared``), each gets half the torch threads:
    torch sizes each op's thread team by the process-wide setting, so half each shares the cores with no
    oversubscription (one CPU demo update, 2 cores: 12.3 -> 11.0 s). Evaluations and SFT, one thread of work each,
    keep all; the setting is restored on exit."""
    import torch

    threads = torch.get_num_threads()
    if shared and threads > 1:
        torch.set_num_threads(max(1, threads // 2))
        log.info("torch threads %d -> %d while the learner and the samplers share the CPU", threads, threads // 2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def prune_model_dirs(checkpoints: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` ``step_N/`` model directories (``loop.keep_checkpoints``); the loop's own
    ``step_NNNNNN/`` checkpoints (with a ``loop.pt``) are :func:`agentenv.trainer.loop_state.prune`'s."""
    dirs = sorted((d for d in checkpoints.glob("step_*")
                   if d.is_dir() and d.name[5:].isdigit() and not (d / "loop.pt").exists()),
                  key=lambda d: int(d.name[5:]))
    gone = dirs[:-keep] if keep else []
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return gone


class OnRolloutSamplers:
    """An evaluation "policy" that plays on the run's rollout samplers (:meth:`Trainer.play`), not a new engine."""

    backend = "rollout samplers"

    def __init__(self, trainer):
        self.trainer = trainer

    def play_episodes(self, make_env, tasks: list, rollout) -> list:
        return self.trainer.play(make_env, tasks, rollout)


def _check_truncated_sampling(cfg: RunConfig, model_path: str, device: str) -> None:
    """top-k / top-p < 1 make mu differ from pi even at lag 0; refuse settings whose gate would reject everything
    (measured: a short real generation from the starting model, scored by the learner's log-probs)."""
    r = cfg.rollout
    if r.top_k == 0 and r.top_p >= 1.0:
        return
    from transformers import AutoTokenizer

    from agentenv.trainer.model_io import load_learner_model
    from agentenv.trainer.preflight import lag0_trust_check

    model = load_learner_model(model_path).to(device)
    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    # a loss without a trust gate (grpo) is measured against the default gate: its ratios are as biased
    delta = getattr(cfg.algo.loss, "delta", FlashReinforceLoss().delta)
    acceptance, kl = lag0_trust_check(model, tok, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                      delta=delta)
    del model
    msg = (f"rollout.top_k={r.top_k} / top_p={r.top_p}: at lag 0 the trust gate admits {acceptance:.0%} of sampled "
           f"sequences (mean sequence KL {kl:.3g} vs delta {delta:g}), because mu is the truncated "
           "distribution and pi the full one. FlashREINFORCE wants top_k=0, top_p=1.")
    if acceptance < 0.5 and not cfg.algo.allow_truncated_sampling:
        raise LaunchError(msg + " Set algo.allow_truncated_sampling=true to run anyway.")
    if acceptance < 0.5:
        log.warning(msg)


def warm_start(cfg: RunConfig, model_path: str, out: Path, *, progress: bool = True, echo=print) -> Path:
    """SFT the starting model on demos (scripted, the env's expert, or a trajectories file); returns the new
    checkpoint dir. Expert demos are played here and kept in ``RUN/sft_demos.jsonl``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv.run import demo
    from agentenv.run.sft import (SFTConfig, demos_path, prepare_demos, save_checkpoint_dir, sft_device,
                                  split_heldout, train_sft)
    from agentenv.core.trajectory import iter_jsonl

    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    model.to(sft_device(cfg.model.device))
    s = cfg.sft
    if s.demos == "scripted":
        easy = cfg.env.demo_easy_fraction  # the demos ask what RL will ask
        demos = demo.demo_trajectories(tok, s.num_demos, s.tool_fraction, seed=cfg.loop.seed + 1, easy_fraction=easy)
        # fresh questions from the held-out side of the demo's question space: never trained on
        heldout = demo.demo_trajectories(tok, s.heldout_demos, s.tool_fraction, seed=cfg.loop.seed + 2,
                                         split="heldout", easy_fraction=easy) if s.heldout_demos else []
    else:
        raw = (expert_demos(cfg, out.parent / "sft_demos.jsonl", progress=progress, echo=echo) if s.demos == "expert"
               else list(iter_jsonl(demos_path(s.demos)))[: s.num_demos])
        demos = prepare_demos(raw, tok, only_successful=s.only_successful, max_tokens=cfg.rollout.max_total_tokens)
        demos, heldout = split_heldout(demos, s.heldout_demos, seed=cfg.loop.seed)
    echo(f"sft warm start: {len(demos)} demos ({s.demos}), {s.epochs} epochs, lr {s.lr}"
         + (f"; {len(heldout)} held-out demos measure it" if heldout else ""))
    r = train_sft(model, demos, SFTConfig(epochs=s.epochs, lr=s.lr, batch_size=s.batch_size, seed=cfg.loop.seed,
                                          context_loss_weight=s.context_loss_weight, schedule=s.schedule),
                  progress=progress, heldout=heldout, echo=echo)
    echo(f"sft done: loss per token {r['loss_first']:.3f} (epoch 1) -> {r['loss_last']:.3f} (epoch {len(r['epochs'])})"
         f" in {r['steps']} steps, {r['wall_s']:.0f}s")
    path = save_checkpoint_dir(model, tok, out)
    (out.parent / "sft_report.json").write_text(json.dumps(r, indent=2))
    return path


def expert_demos(cfg: RunConfig, path: Path, *, progress: bool = True, echo=print) -> list:
    """``sft.num_demos`` episodes of the env's scripted expert (``--model expert``) on the run's TRAINING tasks,
    played through the same runtime, env settings and turn limit as RL, so a demo's prompt, observations and chat
    glue are exactly what the policy will see later. ``sft.expert_noise`` makes the expert take random admissible
    actions on that share of turns. Every episode is written to ``path``; failures stay there but are not imitated."""
    import importlib

    from agentenv.envs import EXPERTS, spec
    from agentenv.core.runtime import EpisodeSpec, RolloutConfig
    from agentenv.run.episodes import EpisodeSet, env_kwargs, rollout_config, task_list
    from agentenv.trainer.backends import GymEnvFactory
    from agentenv.core.trajectory import JsonlWriter

    env_id = spec.resolve(cfg.env.id)
    if env_id not in EXPERTS:
        raise LaunchError(f"sft.demos=expert: environment {env_id} has no scripted expert (experts exist for: "
                          f"{', '.join(EXPERTS)}); use sft.demos=scripted or a trajectories JSONL")
    module, factory = EXPERTS[env_id].split(":")
    expert = getattr(importlib.import_module(module), factory)(noise=cfg.sft.expert_noise, seed=cfg.loop.seed + 1)
    tasks = task_list(cfg)
    n = cfg.sft.num_demos
    r = rollout_config(cfg)
    demos = EpisodeSet(
        make_env=GymEnvFactory(env_id, {**env_kwargs(cfg), **getattr(expert, "env_kwargs", {})}),
        tasks=[EpisodeSpec(seed=10_000 + i, options=tasks[i % len(tasks)].options, meta={"sample": i // len(tasks)})
               for i in range(n)],
        rollout=RolloutConfig(max_turns=r.max_turns, max_total_tokens=r.max_total_tokens, sampling=r.sampling,
                              concurrency=2))
    with JsonlWriter(path) as writer:
        trajs = demos.play(expert, progress=progress, on_trajectory=writer.write)
    won = sum(bool(t.success) for t in trajs)
    echo(f"expert demos: {n} episodes on {len(tasks)} training tasks (noise {cfg.sft.expert_noise:g}), "
         f"{won} won, turns {sum(t.num_turns for t in trajs) / max(1, n):.1f} mean -> {path}")
    if not won:
        reasons = sorted({t.finish_reason for t in trajs})
        raise LaunchError(f"sft.demos=expert: the expert won none of its {n} episodes (finish reasons: "
                          f"{', '.join(map(str, reasons))}), so there is nothing to imitate; raise rollout.max_turns "
                          f"(now {cfg.rollout.max_turns}) or lower sft.expert_noise. Episodes: {path}")
    return trajs
