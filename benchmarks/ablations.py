"""The paper's ablations in miniature: FlashREINFORCE and its variants on the CPU tool task, several seeds each.

What it does (``python benchmarks/ablations.py``):

1. ONE SFT warm start of the tool demo's tiny model (preset ``demo``: scripted demos, few use the python tool),
   shared by every run, so variants differ only in the RL algorithm and the seed.
2. For every variant x seed: ``agentenv.run.train.run`` of the ``demo`` preset from that checkpoint with the SAME
   trajectory budget (``--updates`` x ``--batch``; GRPO's batch is ``batch/4`` prompts x 4 samples), writing an
   ordinary run directory (``metrics.jsonl``) under ``--runs-dir``.
3. Curves per comparison (mean over seeds, band = min..max): success, tool-call rate, length (policy tokens per
   trajectory), trust-gate acceptance, policy lag -- one PNG each -- and a table of final values (mean of the last
   ``--final-window`` updates of each run) as mean +- std over seeds, with a verdict per paper claim computed from
   those numbers. Everything goes to ``--out`` (default ``docs/results.md``, figures in ``docs/results/``), with
   settings, seeds, wall times and the machine.

Variants: ``flashreinforce`` (the method), ``token_mean`` (token-mean loss instead of the sample mean), ``no_is``
(no token importance ratio), ``q0.9`` / ``q0.2`` (failure filter: failed trajectories keep that share of their
highest-entropy tokens), ``grpo`` (G = 4 samples per prompt, group baseline, PPO clip, token mean, synchronous), and
under INDUCED LAG (``--lag-queue`` x batch trajectories may be in flight, ``--lag-concurrency`` episodes per worker,
so rollouts run several versions behind the learner): ``flashreinforce_lag`` (gate on) and ``no_trust_lag`` (gate
off). The measured lag of every run is in the table, so "lag >= 4" is checked, not assumed.

``--smoke`` runs every variant for 2 updates of 4 trajectories, one seed, a tiny SFT, into a temporary directory:
the code path CI runs. It checks that every run finished its updates with balanced accounting and exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# variant -> --set overrides on top of the demo preset (batch size / updates / seed are added per run)
VARIANTS: dict[str, list[str]] = {
    "flashreinforce": [],
    "token_mean": ["algo.token_mean=true"],
    "no_is": ["algo.no_is=true"],
    "q0.9": ["algo.negative_token_fraction=0.9"],
    "q0.2": ["algo.negative_token_fraction=0.2"],
    "grpo": ["algo.loss=grpo", "loop.mode=sync_grpo", "loop.group_size=4"],
    "flashreinforce_lag": ["LAG"],
    "no_trust_lag": ["LAG", "algo.no_trust=true"],
}

# comparison name -> (variants overlaid, the paper's claim it tests)
COMPARISONS: dict[str, tuple[list[str], str]] = {
    "length": (["flashreinforce", "token_mean"],
               "the sample-mean loss keeps the length stable where the token mean drifts"),
    "trust_gate_under_lag": (["flashreinforce_lag", "no_trust_lag"], "the sequence trust gate matters under lag"),
    "importance_sampling": (["flashreinforce", "no_is"], "token importance sampling (ratio to the behaviour policy)"),
    "failure_filter": (["flashreinforce", "q0.9", "q0.2"], "failure filter: keep a share q of a failure's tokens"),
    "grpo": (["flashreinforce", "grpo"], "GRPO's tool-call rate falls where FlashREINFORCE's holds"),
}

METRICS = (("success_rate", "success"), ("tool_share", "tool-call rate"), ("policy_tokens_mean", "length (tokens)"),
           ("acceptance_rate", "acceptance"), ("lag_mean", "lag (versions)"))


@dataclass
class Study:
    updates: int
    batch: int
    seeds: list[int]
    variants: list[str]
    lag_queue: int
    lag_concurrency: int
    sft: list[str] = field(default_factory=list)  # overrides for the shared warm start
    threads: int = 1
    final_window: int = 5
    model: str = ""  # the starting model of the shared warm start


def run_overrides(study: Study, variant: str, seed: int, model_dir: str, run_dir: Path) -> list[str]:
    sets = [f"model.name={model_dir}", "sft.enabled=false", "eval.at_start=false", "eval.at_end=false",
            f"loop.total_updates={study.updates}", f"loop.batch_size={study.batch}", f"loop.seed={seed}",
            f"run.dir={run_dir}", "run.tensorboard=false", "run.plot=false", "run.save_trajectories=false",
            f"run.threads={study.threads}"]
    for item in VARIANTS[variant]:
        if item == "LAG":
            sets += [f"loop.queue_size={study.lag_queue}", f"loop.concurrency={study.lag_concurrency}"]
        else:
            sets.append(item)
    return sets


def _run_one(job: tuple[list[str], str]) -> dict:
    """One training run in this process: the demo preset + overrides. Returns its wall time and summary."""
    sets, name = job
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from agentenv.core.config import load_config
    from agentenv.run.train import run

    cfg = load_config("demo", [], sets)
    if cfg.run.dir and Path(cfg.run.dir).exists():  # a rerun replaces its own earlier run, never appends to it
        import shutil

        shutil.rmtree(cfg.run.dir)
    t0 = time.perf_counter()
    res = run(cfg, progress=False, echo=lambda *_: None)
    return {"name": name, "wall_s": time.perf_counter() - t0, "run_dir": str(res.run_dir),
            "updates": int(res.summary.get("updates", len(res.history))),
            "accounting_balance": res.history[-1].get("accounting_balance") if res.history else None}


def warm_start_once(study: Study, out: Path) -> tuple[str, float]:
    """The shared SFT checkpoint (reused when ``out`` already holds one from the same settings)."""
    from agentenv.core.config import load_config
    from agentenv.samplers.models import resolve_model
    from agentenv.run.train import warm_start

    cfg = load_config("demo", [], study.sft)
    stamp = out / "sft_settings.json"
    settings = json.dumps({"sft": cfg.sft.model_dump(), "model": cfg.model.name, "seed": cfg.loop.seed})
    if (out / "config.json").exists() and stamp.exists() and stamp.read_text() == settings:
        return str(out), 0.0
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    warm_start(cfg, resolve_model(cfg.model.name).path, out, progress=False, echo=print)
    stamp.write_text(settings)
    return str(out), time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------- analysis
def read_metrics(run_dir: str | Path) -> list[dict]:
    from agentenv.core.metrics import read_metrics as read

    return [r for r in read(run_dir) if "event" not in r and not r.get("rolled_back")]


def _mean_of(recs: list[dict], key: str) -> float:
    vals = [float(r[key]) for r in recs if isinstance(r.get(key), (int, float))]
    return statistics.fmean(vals) if vals else math.nan  # a metric a variant does not report (GRPO: no gate)


def final_values(recs: list[dict], window: int) -> dict:
    tail = recs[-window:]
    out = {k: _mean_of(tail, k) for k, _ in METRICS}
    out["lag_max"] = max((float(r.get("lag_max", 0)) for r in recs), default=math.nan)
    out["length_start"] = _mean_of(recs[:window], "policy_tokens_mean")
    return out


def mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarise(results: dict[str, list[dict]], window: int) -> dict[str, dict]:
    """variant -> {metric: (mean, std)} over seeds of each run's final values."""
    out = {}
    for v, runs in results.items():
        finals = [final_values(read_metrics(r["run_dir"]), window) for r in runs]
        out[v] = {k: mean_std([f[k] for f in finals]) for k in finals[0]} if finals else {}
        out[v]["wall_s"] = mean_std([r["wall_s"] for r in runs])
    return out


def verdicts(s: dict[str, dict]) -> dict[str, str]:
    """One sentence per comparison, from the table's numbers: a difference counts when it exceeds the larger of the
    two seed standard deviations (with 3 seeds this is a rough screen, not a test)."""

    def differ(a: tuple, b: tuple) -> float | None:
        if any(math.isnan(x) for x in (*a, *b)):
            return None
        d = a[0] - b[0]
        return d if abs(d) > max(a[1], b[1]) else 0.0

    out = {}
    if {"flashreinforce", "token_mean"} <= s.keys():
        drift = {v: (abs(s[v]["policy_tokens_mean"][0] - s[v]["length_start"][0]), max(s[v]["policy_tokens_mean"][1],
                                                                                     s[v]["length_start"][1]))
                 for v in ("flashreinforce", "token_mean")}
        d = differ(drift["token_mean"], drift["flashreinforce"])
        out["length"] = ("reproduces: the token mean's length drifts more" if d and d > 0 else
                         "does not reproduce: the token mean's length drifts less" if d and d < 0 else
                         "not resolved at this budget: the length drifts are within the seed spread")
        out["length"] += (f" (|final - initial| length: sample mean {drift['flashreinforce'][0]:.1f}, "
                          f"token mean {drift['token_mean'][0]:.1f} tokens)")
    if {"flashreinforce_lag", "no_trust_lag"} <= s.keys():
        lag = min(s["flashreinforce_lag"]["lag_mean"][0], s["no_trust_lag"]["lag_mean"][0])
        d = differ(s["flashreinforce_lag"]["success_rate"], s["no_trust_lag"]["success_rate"])
        out["trust_gate_under_lag"] = (
            ("reproduces: with the gate success is higher" if d and d > 0 else
             "does not reproduce: without the gate success is higher" if d and d < 0 else
             "not resolved at this budget: success with and without the gate is within the seed spread")
            + f" (measured mean lag {lag:.1f} versions{'' if lag >= 4 else ', below the intended 4'})")
    if {"flashreinforce", "grpo"} <= s.keys():
        d = differ(s["grpo"]["tool_share"], s["flashreinforce"]["tool_share"])
        out["grpo"] = ("reproduces: GRPO's final tool-call rate is lower" if d and d < 0 else
                       "does not reproduce: GRPO's final tool-call rate is higher" if d and d > 0 else
                       "not resolved at this budget: the tool-call rates are within the seed spread")
    if {"flashreinforce", "no_is"} <= s.keys():
        d = differ(s["no_is"]["success_rate"], s["flashreinforce"]["success_rate"])
        out["importance_sampling"] = ("without IS success is lower" if d and d < 0 else
                                      "without IS success is higher" if d and d > 0 else
                                      "no difference beyond the seed spread at this budget (lag is small here, so "
                                      "the ratio is close to 1)")
    if {"flashreinforce", "q0.9", "q0.2"} <= s.keys():
        best = max(("flashreinforce", "q0.9", "q0.2"), key=lambda v: s[v]["success_rate"][0])
        out["failure_filter"] = f"highest final success: {best} (see the table for the spread)"
    return out


def plot_comparison(name: str, variants: list[str], results: dict[str, list[dict]], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.6), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ci, v in enumerate(variants):
        runs = [read_metrics(r["run_dir"]) for r in results.get(v, [])]
        runs = [r for r in runs if r]
        if not runs:
            continue
        n = min(len(r) for r in runs)
        xs = [runs[0][i]["update"] for i in range(n)]
        for ax, (key, label) in zip(axes, METRICS):
            ys = [[float(r[i].get(key, math.nan)) for r in runs] for i in range(n)]
            mean = [statistics.fmean(y) for y in ys]
            ax.plot(xs, mean, color=colors[ci % len(colors)], linewidth=2, label=f"{v} ({len(runs)} seeds)")
            if len(runs) > 1:
                ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=colors[ci % len(colors)],
                                alpha=0.15, linewidth=0)
            ax.set_title(label)
            ax.set_xlabel("update")
            ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{name}: {title} (mean over seeds; band: min..max)", fontsize=11)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def fmt(ms: tuple[float, float], digits: int = 2) -> str:
    m, s = ms
    return "n/a" if math.isnan(m) else f"{m:.{digits}f} ± {s:.{digits}f}"


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:  # no /proc (not Linux): platform's answer above stands
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs visible, Python {platform.python_version()}, torch "
            f"{torch.__version__}, {platform.system()} {platform.release()}")


def write_report(study: Study, results: dict[str, list[dict]], summary: dict, verdict: dict, plots: dict[str, Path],
                 out: Path, *, sft_wall: float, total_wall: float, smoke: bool, command: str,
                 skipped: list[str] = ()) -> None:
    rel = lambda p: os.path.relpath(p, out.parent)  # noqa: E731
    lines = [
        "# Ablations in miniature: FlashREINFORCE variants on the CPU tool task",
        "",
        f"_Regenerated by `{command}`. Do not edit by hand._" + (" **SMOKE RUN: 2 updates, numbers mean nothing.**"
                                                                 if smoke else ""),
        "",
        f"- Task: the `demo` preset (tiny model `{study.model}`, 6-digit multiplications where only the python "
        f"tool's output is right), one shared SFT warm start"
        f"{'' if math.isnan(sft_wall) else f' ({sft_wall:.0f} s)'}, then RL.",
        f"- Budget per run: {study.updates} updates x {study.batch} trajectories = {study.updates * study.batch} "
        f"trajectories, for every variant (GRPO: {study.batch // 4} prompts x 4 samples per update).",
        f"- Seeds: {', '.join(map(str, study.seeds))} (`loop.seed`: prompt order and sampling; the warm start is shared).",
        f"- Induced lag (`*_lag`): `loop.queue_size={study.lag_queue}`, `loop.concurrency={study.lag_concurrency}` "
        f"per worker (2 workers); other runs use the preset's queue size 1, concurrency 8.",
        f"- Final value = mean over the last {study.final_window} updates of a run (batch metrics of the "
        "trajectories trained on); table: mean ± std over seeds.",
        f"- Wall time: {total_wall / 60:.1f} min in all ({study.threads} torch thread(s) per run). Machine: {machine()}.",
        *([f"- **Not run** (time budget spent): {', '.join(skipped)}."] if skipped else []),
        "",
        "| variant | success | tool-call rate | length (tokens) | length at start | acceptance | lag mean | lag max | wall s / run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for v in study.variants:
        if v not in summary:
            continue
        s = summary[v]
        lines.append(f"| {v} | {fmt(s['success_rate'])} | {fmt(s['tool_share'])} | {fmt(s['policy_tokens_mean'], 1)} | "
                     f"{fmt(s['length_start'], 1)} | {fmt(s['acceptance_rate'])} | {fmt(s['lag_mean'], 1)} | "
                     f"{fmt(s['lag_max'], 0)} | {fmt(s['wall_s'], 0)} |")
    lines += ["", "## The paper's directions, checked", ""]
    for name, (variants, claim) in COMPARISONS.items():
        if name in plots:
            lines.append(f"- **{name}** ({' vs '.join(variants)}): _{claim}_ -- {verdict.get(name, 'n/a')}. "
                         f"![{name}]({rel(plots[name])})")
    lines += ["", "Runs (`metrics.jsonl` per run):", ""]
    for v in study.variants:
        for r in results.get(v, []):
            d = Path(r["run_dir"]).resolve()
            d = d.relative_to(REPO) if d.is_relative_to(REPO) else d
            lines.append(f"- {r['name']}: {r['updates']} updates, {r['wall_s']:.0f} s, `{d}`")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--batch", type=int, default=16, help="trajectories per update (a multiple of 4, for GRPO's G=4)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--lag-queue", type=int, default=6)
    p.add_argument("--lag-concurrency", type=int, default=48)
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (separate processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--final-window", type=int, default=5)
    p.add_argument("--budget-min", type=float, default=None,
                   help="stop starting runs after this many minutes (sequential mode); the report says what was left")
    p.add_argument("--runs-dir", default=None, help="where run directories go (default runs/ablations; smoke: a temp dir)")
    p.add_argument("--out", default=None, help="report path (default docs/results.md; smoke: RUNS_DIR/results.md)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: rebuild the report and figures from the finished runs under --runs-dir")
    p.add_argument("--smoke", action="store_true", help="2 updates x 4 trajectories per variant, 1 seed, tiny SFT")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_all = time.perf_counter()
    if args.smoke:
        args.updates, args.batch, args.seeds, args.lag_queue, args.lag_concurrency = 2, 4, args.seeds[:1], 2, 4
        sft = ["sft.num_demos=8", "sft.epochs=1", "sft.batch_size=4", "model.name=tiny-bpe:64x2"]
        extra = ["rollout.max_new_tokens=8", "env.num_tasks=16", "loop.num_workers=1", "loop.concurrency=2"]
    else:
        sft, extra = [], []
    if args.batch % 4:
        raise SystemExit(f"--batch {args.batch}: must be a multiple of 4 (GRPO uses groups of 4)")
    runs_dir = Path(args.runs_dir or (tempfile.mkdtemp(prefix="ablations-smoke-") if args.smoke
                                      else REPO / "runs" / "ablations"))
    out = Path(args.out) if args.out else (runs_dir / "results.md" if args.smoke else REPO / "docs" / "results.md")
    study = Study(args.updates, args.batch, list(args.seeds), list(args.variants), args.lag_queue, args.lag_concurrency,
                  sft=sft, threads=args.threads, final_window=min(args.final_window, args.updates))

    from agentenv.core.config import load_config

    study.model = load_config("demo", [], sft).model.name
    if args.report_only:  # rebuild the report from finished runs already under --runs-dir (e.g. a study cut short)
        model_dir, sft_wall = str(runs_dir / "sft_model"), math.nan
    else:
        model_dir, sft_wall = warm_start_once(study, runs_dir / "sft_model")
        print(f"warm start: {model_dir} ({sft_wall:.0f}s)")
    jobs = [(run_overrides(study, v, seed, model_dir, runs_dir / f"{v}-seed{seed}") + extra, f"{v}-seed{seed}")
            for seed in study.seeds for v in study.variants]
    done: list[dict] = []
    command = ("python benchmarks/ablations.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()

    def report(final: bool) -> None:
        """(Re)write the report from the runs finished so far: a study cut short by --budget-min still reports."""
        results: dict[str, list[dict]] = {v: [] for v in study.variants}
        for r in done:
            results[r["name"].rsplit("-seed", 1)[0]].append(r)
        summary = summarise({v: rs for v, rs in results.items() if rs}, study.final_window)
        figdir = out.parent / (out.stem if not args.smoke else "figures")
        plots = {name: plot_comparison(name, vs, results, figdir / f"{name}.png", claim)
                 for name, (vs, claim) in COMPARISONS.items() if all(results.get(v) for v in vs)} if final else {}
        skipped = [name for _, name in jobs if name not in {r["name"] for r in done}]
        total = (sum(r["wall_s"] for r in done if not math.isnan(r["wall_s"])) if args.report_only
                 else time.perf_counter() - t_all)
        write_report(study, results, summary, verdicts(summary), plots, out, sft_wall=sft_wall,
                     total_wall=total, smoke=args.smoke, command=command, skipped=skipped)

    deadline = t_all + args.budget_min * 60 if args.budget_min else math.inf
    if args.report_only:
        for _, name in jobs:
            d = runs_dir / name
            recs = read_metrics(d) if (d / "metrics.jsonl").exists() else []
            if len(recs) == study.updates:
                summ = json.loads((d / "summary.json").read_text()) if (d / "summary.json").exists() else {}
                done.append({"name": name, "run_dir": str(d), "updates": len(recs),
                             "wall_s": float(summ.get("summary", {}).get("wall_s", math.nan)),
                             "accounting_balance": recs[-1].get("accounting_balance")})
    elif args.jobs > 1:
        import multiprocessing as mp

        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as pool:
            for r in pool.map(_run_one, jobs):
                done.append(r)
                print(f"  {r['name']}: {r['updates']} updates, {r['wall_s']:.0f}s", flush=True)
    else:
        for i, job in enumerate(jobs):
            if time.perf_counter() > deadline:
                print(f"--budget-min {args.budget_min} spent: {len(jobs) - i} runs not started", flush=True)
                break
            r = _run_one(job)
            done.append(r)
            print(f"  {r['name']}: {r['updates']} updates, {r['wall_s']:.0f}s", flush=True)
            if (i + 1) % len(study.variants) == 0:  # a whole seed done: keep the report current
                report(final=False)
    report(final=True)
    print(out.read_text())
    bad = [r["name"] for r in done if r["updates"] != study.updates or r["accounting_balance"] != 0]
    if bad:
        print(f"runs that did not finish their {study.updates} updates with balanced accounting: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
