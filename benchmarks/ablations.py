"""The paper's ablations in miniature, built to answer their questions: FlashREINFORCE and its variants on the CPU
tool task, many seeds, evaluated on held-out questions, compared by tests.

What it does (``python benchmarks/ablations.py``):

1. ONE SFT warm start of the demo's tiny model (preset ``demo``, its demos drawn from the same task mix as RL's,
   easy questions included), shared by every run, and one held-out evaluation of it (``ROOT/warm_start.json``):
   variants differ only in the RL algorithm and the seed.
2. The task is the demo's with ``env.demo_easy_fraction`` (``--easy``, default 0.3) of easy questions (``A * 100``,
   which the no-tool guess answers right): giving the tool up is sometimes rewarded, so GRPO's tool-call collapse
   can show, and answers may grow (token mean vs sample mean).
3. For every variant x seed: ``agentenv.run.train.run`` with the SAME trajectory budget (``--updates`` x ``--batch``;
   GRPO's batch is ``batch/4`` prompts x 4 samples), then an evaluation of the final weights on the ``heldout`` split
   (``--eval-episodes`` questions no SFT or RL step saw). Its outcome is saved at once as
   ``ROOT/results/VARIANT-seedS.json``; a rerun skips every (variant, seed) that has one, so the study resumes
   where it stopped. ``--only`` runs some variants, ``--parts I/N`` the I-th of N interleaved slices of what is
   left (separate processes or sessions can share one root). ``ROOT/settings.json`` records the design (updates,
   batch, lag, easy share, evaluation size): a call with other options is refused rather than mixed in.
4. The lag variants (``*_lag``) use the fixed-lag harness ``loop.fixed_lag=--lag`` (synchronous rounds whose
   samplers hold the weights exactly ``--lag`` versions behind the learner): ``flashreinforce_lag`` (gate on),
   ``no_trust_lag`` (gate off), ``no_is_lag`` (the paper's no-IS: ratio 1, the gate admits everything).
5. The report (``--out``, default ``docs/results.md``) is written from the saved results only (``--report-only``
   rebuilds it without running anything, from the saved design; a root with no results is refused, so an empty
   table never replaces a full one) by :mod:`ablations_report`: mean and 95% CI per variant, Welch tests with
   Holm's correction across comparisons, the minimal detectable effect at the observed seed spread, and which of the
   paper's directions reproduce, are refuted, or are unresolved at this budget.

``--smoke``: 2 updates x 4 trajectories, one seed, a tiny SFT, 4 held-out questions, into a temporary root unless
``--root`` is given -- the code path CI runs. Exit status 1 when a run did not finish its updates with balanced
accounting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ablations_report as report  # noqa: E402  (the sibling module, importable however this file is loaded)
from studies import one_design, parse_parts  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LAG = ["loop.mode=sync_grpo", "loop.group_size=1", "loop.fixed_lag={lag}"]

# variant -> --set overrides on top of the demo preset ({lag} is --lag)
VARIANTS: dict[str, list[str]] = {
    "flashreinforce": [],
    "token_mean": ["algo.loss.token_mean=true"],
    "q0.9": ["algo.loss.negative_token_fraction=0.9"],
    "q0.2": ["algo.loss.negative_token_fraction=0.2"],
    "grpo": ["algo.loss.type=grpo", "loop.mode=sync_grpo", "loop.group_size=4"],
    "flashreinforce_lag": LAG,
    "no_trust_lag": LAG + ["algo.loss.no_trust=true"],
    "no_is_lag": LAG + ["algo.loss.no_is=true"],
}
SMOKE_SFT = ["sft.num_demos=8", "sft.epochs=1", "sft.batch_size=4", "model.name=tiny-bpe:64x2"]
SMOKE_RUN = ["rollout.max_new_tokens=8", "env.num_tasks=16", "loop.num_workers=1", "loop.concurrency=2"]


def run_overrides(args, variant: str, seed: int, model_dir: str, run_dir: Path) -> list[str]:
    sets = [f"model.name={model_dir}", "sft.enabled=false", "eval.at_start=false", "eval.at_end=true",
            "eval.splits=[heldout]", f"eval.episodes={args.eval_episodes}", f"env.demo_easy_fraction={args.easy}",
            f"loop.total_updates={args.updates}", f"loop.batch_size={args.batch}", f"loop.seed={seed}",
            f"run.dir={run_dir}", "run.tensorboard=false", "run.plot=false", "run.save_trajectories=false",
            f"run.threads={args.threads}"]
    return sets + [s.format(lag=args.lag) for s in VARIANTS[variant]] + (SMOKE_RUN if args.smoke else [])


def outcome(res, lag: int) -> dict:
    """What a finished run contributes: its held-out evaluation and what its training measured (lag, gate)."""
    ev = res.evals[-1]
    steady = [r for r in res.history if r["update"] > lag] or res.history  # after the fixed lag has built up

    def mean(key: str, recs: list[dict]) -> float | None:
        vals = [float(r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else None  # a metric a variant does not have (GRPO: no gate)

    return {"heldout": {k: ev.get(k) for k in ("success_rate", "tool_call_rate", "policy_tokens_mean", "episodes",
                                               "successes", "success_multiply", "success_multiply_easy")},
            "train": {"updates": len(res.history), "lag_mean": mean("lag_mean", steady),
                      "lag_max": max((r.get("lag_max", 0) for r in res.history), default=None),
                      "acceptance_rate": mean("acceptance_rate", steady), "seq_kl_mean": mean("seq_kl_mean", steady),
                      "accounting_balance": res.history[-1].get("accounting_balance") if res.history else None}}


def run_one(args, variant: str, seed: int, model_dir: str) -> dict:
    from agentenv.core.config import load_config
    from agentenv.run.train import run

    run_dir = Path(args.root) / "runs" / f"{variant}-seed{seed}"
    if run_dir.exists():  # a run that stopped before saving its result: start it again from scratch
        shutil.rmtree(run_dir)
    cfg = load_config("demo", [], run_overrides(args, variant, seed, model_dir, run_dir))
    t0 = time.perf_counter()
    res = run(cfg, progress=False, echo=lambda *_: None)
    return {"variant": variant, "seed": seed, "wall_s": time.perf_counter() - t0, "run_dir": str(run_dir),
            "overrides": [s.format(lag=args.lag) for s in VARIANTS[variant]], **outcome(res, args.lag)}


def warm_start_once(args, root: Path) -> str:
    """The shared SFT checkpoint (reused when the root holds one from the same settings)."""
    from agentenv.core.config import load_config
    from agentenv.samplers.models import resolve_model
    from agentenv.run.train import warm_start

    out = root / "sft_model"
    cfg = load_config("demo", [], [f"env.demo_easy_fraction={args.easy}", *(SMOKE_SFT if args.smoke else [])])
    stamp = root / "sft_settings.json"
    settings = json.dumps({"sft": cfg.sft.model_dump(), "model": cfg.model.name, "seed": cfg.loop.seed,
                           "easy_fraction": cfg.env.demo_easy_fraction})
    if (out / "config.json").exists() and stamp.exists() and stamp.read_text() == settings:
        return str(out)
    if stamp.exists() or any((root / "results").glob("*.json")):  # results of another warm start must not mix in
        raise SystemExit(f"ablations: {root} holds runs from a warm start with other settings ({stamp.name} differs); "
                         "give a new --root, or move that one aside")
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    t0 = time.perf_counter()
    warm_start(cfg, resolve_model(cfg.model.name).path, out, progress=False, echo=print)
    stamp.write_text(settings)
    (root / "sft_wall.json").write_text(json.dumps({"wall_s": time.perf_counter() - t0}))
    return str(out)


def evaluate_warm_start(args, root: Path, model_dir: str) -> None:
    """The warm start's own held-out evaluation (the length every variant drifts from), once per root."""
    path = root / "warm_start.json"
    if path.exists():
        return
    from agentenv.core.config import load_config
    from agentenv.run.train import run

    sets = run_overrides(args, "flashreinforce", 0, model_dir, root / "runs" / "warm_start_eval")
    res = run(load_config("demo", [], sets), eval_only=True, progress=False, echo=lambda *_: None)
    ev = res.evals[-1]
    path.write_text(json.dumps({k: ev.get(k) for k in ("success_rate", "tool_call_rate", "policy_tokens_mean",
                                                       "episodes", "successes")}, indent=2))


DESIGN = ("updates", "batch", "lag", "easy", "eval_episodes", "smoke")  # what makes two runs comparable


def design(args, root: Path) -> None:
    """One root, one design (:func:`studies.one_design` over :data:`DESIGN`): a report takes the saved one."""
    vars(args).update(one_design(root, {k: getattr(args, k) for k in DESIGN}, study="ablations",
                                 report_only=args.report_only))


def pending_jobs(args, root: Path) -> list[tuple[str, int]]:
    todo = [(v, s) for s in args.seeds for v in args.only if not (root / "results" / f"{v}-seed{s}.json").exists()]
    i, n = args.parts
    return todo[i - 1::n]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=None, help="run root (default runs/ablations; smoke: a temporary directory)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(16)))
    p.add_argument("--only", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), help="variants to run")
    p.add_argument("--parts", type=parse_parts, default=(1, 1), metavar="I/N", help="run the I-th of N slices")
    p.add_argument("--updates", type=int, default=80, help="updates per run (the demo preset's 80, at its lr)")
    p.add_argument("--batch", type=int, default=16, help="trajectories per update (a multiple of 4, for GRPO's G=4)")
    p.add_argument("--lag", type=int, default=8, help="the *_lag variants' fixed lag in updates")
    p.add_argument("--easy", type=float, default=0.3, help="share of easy questions (env.demo_easy_fraction)")
    p.add_argument("--eval-episodes", type=int, default=256,
                   help="held-out questions per evaluation (256: binomial sd <= 0.031, under the paper's gap)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per run")
    p.add_argument("--alpha", type=float, default=0.05, help="family-wise error rate of the comparisons")
    p.add_argument("--out", default=None, help="report path (default docs/results.md; smoke: ROOT/results.md)")
    p.add_argument("--report-only", action="store_true", help="run nothing: write the report from saved results")
    p.add_argument("--smoke", action="store_true", help="2 updates x 4 trajectories, 1 seed, tiny SFT, 4 questions")
    args = p.parse_args(argv)
    if args.smoke:
        args.updates, args.batch, args.seeds, args.lag, args.eval_episodes = 2, 4, args.seeds[:1], 1, 4
    if args.batch % 4:
        p.error(f"--batch {args.batch}: must be a multiple of 4 (GRPO uses groups of 4)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = Path(args.root or (tempfile.mkdtemp(prefix="ablations-smoke-") if args.smoke
                              else REPO / "runs" / "ablations"))
    if not args.report_only:  # a report reads; it makes no directories
        (root / "results").mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (root / "results.md" if args.smoke else REPO / "docs" / "results.md")
    command = ("python benchmarks/ablations.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    bad = []
    design(args, root)
    if not args.report_only:
        model_dir = warm_start_once(args, root)
        evaluate_warm_start(args, root, model_dir)
        jobs = pending_jobs(args, root)
        print(f"ablations: {len(jobs)} runs to do under {root}", flush=True)
        for variant, seed in jobs:
            r = run_one(args, variant, seed, model_dir)
            ok = r["train"]["updates"] == args.updates and r["train"]["accounting_balance"] == 0
            if ok:  # only a complete run is a result; an incomplete one is rerun next time
                (root / "results" / f"{variant}-seed{seed}.json").write_text(json.dumps(r, indent=2))
            else:
                bad.append(f"{variant}-seed{seed}")
            print(f"  {variant}-seed{seed}: held-out success {r['heldout']['success_rate']:.3f}, tool "
                  f"{r['heldout']['tool_call_rate']:.3f}, {r['wall_s']:.0f}s{'' if ok else ' (INCOMPLETE)'}", flush=True)
    if not any((root / "results").glob("*.json")):  # an empty report would overwrite the one that has results
        print(f"ablations: no saved runs under {root}/results: nothing to report, {out} left as it is "
              "(run the study, or pass the --root that holds it)", file=sys.stderr)
        return 2 if args.report_only else int(bool(bad))
    text = report.write(root, out, settings=vars(args) | {"variants": list(VARIANTS)}, command=command,
                        smoke=args.smoke)
    print(text)
    if bad:
        print(f"runs that did not finish their {args.updates} updates with balanced accounting: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
