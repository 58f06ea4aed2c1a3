"""``agentenv run``: execute the launch plan of a :class:`~agentenv.core.config.RunConfig`.

Contract of :func:`run(cfg)`:

1. The plan (:func:`agentenv.run.plan.launch_plan`) is computed once; any reason it cannot start stops the run before
   anything heavy (:class:`~agentenv.run.plan.LaunchError`, with the fix). It is saved as ``RUN/plan.json`` next to the
   resolved ``RUN/config.yaml``.
2. Optional SFT warm start (``sft.enabled``) into ``RUN/sft_model``.
3. The parts the plan names are built -- samplers (:func:`policy_factory`: transformers or vLLM), the learner
   (:func:`agentenv.trainer.distributed.make_learner`: one process, or FSDP2 ranks) -- and wired by
   :class:`agentenv.trainer.loop.Trainer`; every update goes to ``RUN/metrics.jsonl`` / TensorBoard / one
   ``[update N]`` line (:class:`agentenv.core.metrics.MetricsLogger`), every trajectory to ``RUN/trajectories.jsonl``.
4. Evaluation (:mod:`agentenv.run.evaluation`) at the start, every ``eval.every`` updates and at the end, always with the
   learner's CURRENT weights, whatever the rollout backend.
5. ``algo.average_last_updates`` = N > 0: when the loop finishes (not on Ctrl-C), the learner's weights become the
   mean of its weights after each of the last N updates (:meth:`Learner.use_average`); the final evaluation (its
   records carry ``weights``) and ``RUN/final_model`` are of that mean, checkpoints of the weights rollouts used.
   The trained policy is saved as a Hugging Face model directory: ``RUN/final_model`` and, at
   ``loop.checkpoint_every``, ``RUN/checkpoints/step_N/model``. ``RUN/summary.json`` records the loop's summary,
   the evaluations and ``components``: what actually started (it equals the plan's).
6. ``resume=True`` continues ``RUN`` from its latest checkpoint (``agentenv run --resume RUN``).
Ctrl-C: the loop finishes the update in flight, checkpoints and shuts down; the end-of-run outputs still appear.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agentenv.core.config import RunConfig
from agentenv.run.plan import LaunchError, launch_plan, preflight, print_plan

log = logging.getLogger("agentenv.run.train")

__all__ = ["LaunchError", "RunResult", "dry_run", "policy_factory", "run"]


def dry_run(cfg: RunConfig, out=print) -> int:
    return print_plan(cfg, launch_plan(cfg), out)


def policy_factory(cfg: RunConfig, model_path: str, plan: dict):
    """A picklable ``make_policy(worker_index)`` for the sampler the plan names (weights in the compute dtype)."""
    from agentenv.samplers.factory import sampler_factory

    dtype = plan["components"]["learner"]["compute_dtype"]
    if plan["components"]["sampler"] == "vllm":
        return sampler_factory(model_path, "vllm", seed=cfg.loop.seed, dtype=dtype,
                               gpu_memory_utilization=cfg.launch.vllm_gpu_memory_utilization,
                               tensor_parallel=cfg.launch.vllm_tensor_parallel,
                               enable_sleep_mode=plan["sleep_samplers_during_update"],
                               max_model_len=cfg.rollout.max_total_tokens)
    return sampler_factory(model_path, "hf", seed=cfg.loop.seed, device=plan["device"],
                           dtype=dtype if plan["device"].startswith("cuda") else "float32")


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
    import torch

    from agentenv.run.evaluation import evaluate
    from agentenv.core.metrics import MetricsLogger
    from agentenv.run.episodes import EpisodeSet
    from agentenv.trainer.distributed import make_learner
    from agentenv.trainer.loop import Trainer

    plan = launch_plan(cfg)
    preflight(plan)
    for note in plan["notes"]:
        log.warning("%s", note)
    if plan["context_tokens"] < cfg.rollout.max_total_tokens:  # the model's positions cap the context
        cfg = cfg.model_copy(deep=True)
        cfg.rollout.max_total_tokens = plan["context_tokens"]
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    run_dir = make_run_dir(cfg)
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    echo(f"run dir: {run_dir}  (config.yaml, plan.json saved)")
    t_start = time.perf_counter()
    model_path = plan["model"]["path"]

    if cfg.sft.enabled and not eval_only:  # 1. warm start (a resumed run reuses it)
        sft_dir = run_dir / "sft_model"
        model_path = str(sft_dir if resume and (sft_dir / "config.json").exists()
                         else warm_start(cfg, model_path, sft_dir, progress=progress, echo=echo))

    evals: list[dict] = []
    logger = MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                           collapse_window=cfg.run.collapse_window, collapse_ratio=cfg.run.collapse_ratio,
                           config=cfg.to_dict(), echo=echo, no_learning_updates=cfg.run.no_learning_updates)
    make_policy = policy_factory(cfg, model_path, plan)

    def do_eval(policy, step: int, weights: str | None = None) -> None:
        for split in (cfg.eval.splits or [None]):
            m = evaluate(cfg, policy, split, progress=progress)
            if weights:
                m["weights"] = weights
            logger.log_eval(step, split or "train_tasks", m)
            evals.append({"update": step, "split": split or "train_tasks", **m})

    if eval_only:
        do_eval(make_policy(0), 0)
        logger.close()
        summary = {"eval_only": True, "evals": evals, "components": {"sampler": plan["components"]["sampler"]}}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return RunResult(run_dir, summary, [], evals)

    # 2. the check that the gate can admit anything at these sampling settings, then the learner the plan names
    _check_truncated_sampling(cfg, model_path, plan["device"])
    placement = None
    if cfg.loop.backend == "ray":  # Ray starts here: the learner ranks and the engines share its placement
        from agentenv.trainer.placement import make_placement

        placement = make_placement(cfg, plan)
    learner = None
    try:
        learner = make_learner(cfg, model_path, device=plan["device"], placement=placement)
        episodes = EpisodeSet.of(cfg)
        end: dict = {"averaged": 0, "weights": None}

        def current_weights_policy():
            """The rollout samplers, holding the learner's current weights: the local backend's own sampler, or
            the Ray actors' engines (evaluation never starts an engine of its own)."""
            local = trainer.local_policy()
            if local is not None:
                if getattr(local, "policy_version", None) != learner.policy_version:  # the weight average swapped in
                    local.load_weights(learner.export_weights(), learner.policy_version)
                return local
            return OnRolloutSamplers(trainer)

        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=cfg.loop.total_updates, desc="updates", unit="upd", dynamic_ncols=True, file=sys.stderr)

        def on_update(m: dict) -> None:
            if bar is not None:
                bar.update(1)
                bar.set_postfix(success=f"{m.get('success_rate', 0):.2f}", tool=f"{m.get('tool_share', 0):.2f}")
            step = int(m["update"])
            if cfg.eval.every and step % cfg.eval.every == 0:
                do_eval(current_weights_policy(), step)
            if cfg.loop.checkpoint_every and step % cfg.loop.checkpoint_every == 0:
                learner.save_pretrained(run_dir / "checkpoints" / f"step_{step}" / "model", source=model_path)

        def on_start() -> None:
            if cfg.eval.at_start and not resume:
                do_eval(current_weights_policy(), trainer.step)  # the starting weights (kept for later evaluations)

        def on_end() -> None:  # the loop finished (not Ctrl-C); the samplers are still up for the final evaluation
            end["averaged"] = averaged = learner.use_average()
            if averaged > 1:
                end["weights"] = f"mean of the weights after updates {trainer.step - averaged + 1}-{trainer.step}"
                echo(f"final weights: the {end['weights']} (algo.average_last_updates={cfg.algo.average_last_updates})")
            # weights that eval.every just measured are not run again
            measured = bool(evals) and evals[-1]["update"] == trainer.step and not end["weights"]
            if cfg.eval.at_end and not measured:
                do_eval(current_weights_policy(), trainer.step, end["weights"])

        trainer = Trainer(cfg.loop, rollout=episodes.rollout, launch=cfg.launch, make_env=episodes.make_env,
                          make_policy=make_policy, learner=learner, tasks=episodes.tasks, run_dir=run_dir, resume=resume,
                          metrics=logger, on_update=on_update, save_trajectories=cfg.run.save_trajectories,
                          sleep_samplers_during_update=plan["sleep_samplers_during_update"], placement=placement,
                          on_start=on_start, on_end=on_end)
        threads = torch.get_num_threads()
        if cfg.loop.mode == "async" and cfg.loop.backend == "local" and cfg.model.backend == "hf" \
                and str(plan["device"]).startswith("cpu") and threads > 1:
            # The learner and the local samplers now compute at once, each on its own thread, and torch sizes each
            # op's thread team by the process-wide setting: half each shares the cores with no oversubscription
            # (one CPU demo update, 2 cores: 12.3 -> 11.0 s). Evaluations and SFT, one thread of work each, keep all.
            torch.set_num_threads(max(1, threads // 2))
            log.info("torch threads %d -> %d while the learner and the samplers share the CPU", threads, threads // 2)
        try:
            summary = trainer.run()
        finally:
            torch.set_num_threads(threads)
            if bar is not None:
                bar.close()
        summary["averaged_updates"] = end["averaged"]
        summary["eval_s"] = sum(e.get("wall_s", 0.0) for e in evals)  # what evaluation cost the run
        final = run_dir / "final_model"
        learner.save_pretrained(final, source=model_path)
        echo(f"model: {final}  (a Hugging Face model directory: --model {final})")
        learner_placement = learner.placement() if hasattr(learner, "placement") else None
        learner_components = learner.components()
    finally:
        if learner is not None:
            learner.close()
        if placement is not None:
            placement.close()
    logger.close()
    summary["wall_s"] = time.perf_counter() - t_start
    from agentenv.core.metrics import read_metrics
    from agentenv.core.stall import step_counts

    summary.update(step_counts(read_metrics(run_dir)))  # the whole run's updates, a resumed run's included
    summary["no_learning_warning"] = logger.stall.warned
    components = {**trainer.components, "learner": learner_components}
    if "placement" in components:  # where Ray put the learner ranks (None: the learner ran in this process)
        components["placement"] = {"learner": learner_placement or [], **components["placement"]}
    (run_dir / "summary.json").write_text(json.dumps({"summary": summary, "components": components, "evals": evals,
                                                      "final_model": str(final)}, indent=2, default=str))
    if cfg.run.plot and logger.history and not trainer.interrupted:
        from agentenv.run.plot import plot_runs

        png = plot_runs([run_dir], title=f"{cfg.preset} {' '.join(cfg.variants)} ({cfg.model.name})")
        echo(f"plot: {png}")
    echo(f"done: {trainer.step} updates in {summary['wall_s']:.0f}s -> {run_dir}")
    return RunResult(run_dir, {**summary, "components": components}, logger.history, evals)


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
    acceptance, kl = lag0_trust_check(model, tok, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                      delta=cfg.algo.delta)
    del model
    msg = (f"rollout.top_k={r.top_k} / top_p={r.top_p}: at lag 0 the trust gate admits {acceptance:.0%} of sampled "
           f"sequences (mean sequence KL {kl:.3g} vs delta {cfg.algo.delta:g}), because mu is the truncated "
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
    from agentenv.run.sft import SFTConfig, demos_path, prepare_demos, save_checkpoint_dir, split_heldout, train_sft
    from agentenv.core.trajectory import iter_jsonl

    tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch.float32)
    s = cfg.sft
    if s.demos == "scripted":
        demos = demo.demo_trajectories(tok, s.num_demos, s.tool_fraction, seed=cfg.loop.seed + 1)
        # fresh questions from the held-out side of the demo's question space: never trained on
        heldout = demo.demo_trajectories(tok, s.heldout_demos, s.tool_fraction, seed=cfg.loop.seed + 2,
                                         split="heldout") if s.heldout_demos else []
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
