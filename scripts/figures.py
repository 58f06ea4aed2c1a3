"""Regenerate the figures the README and docs/ state, from runs of the current code, stamped with commit, date, machine.

    python scripts/figures.py demo --seeds 0 1 2 3 4             # run what is missing, then write docs/demo.md
    python scripts/figures.py demo --seeds 0 1 2 3 4 --no-run    # only read the saved runs
    python scripts/figures.py ablations --parts 1/4               # a quarter of what is left of the study
    python scripts/figures.py ablations --no-run                  # only read the saved results
    python scripts/figures.py alfworld --parts 1/4                # a quarter of what is left of the ALFWorld study
    python scripts/figures.py alfworld --no-run                   # only read its saved results
    python scripts/figures.py stability -- --max-hours 2          # the demo stability study, a session's slice

Each figure has a run root (``runs/figures/<figure>/``) holding one run directory per seed; a seed whose run finished
(its ``demo_result.json`` exists) is read, not rerun, so a long study runs in parts and resumes where it stopped. A run
that did not finish is moved aside (``seedN.failed-<time>``) and started again. The tables are written whole by this
script: nothing in them is edited by hand. What a committed table was read from is copied beside it into
``docs/data/<figure>/`` (results, settings; the demo's runs' results and their metrics' main columns), and
``--no-run`` without ``--runs`` reads that: a fresh clone regenerates every committed table, and a test holds them
equal. A study root with no saved results is refused rather than written up as an empty table.

Figures:

* ``demo`` -- ``agentenv demo`` (the README's first command) on seeds: held-out success and tool-call rate before and
  after RL with Wilson intervals, SFT's held-out NLL per demo kind, wall time per run. Writes ``docs/demo.md``.
* ``ablations`` -- the paper's ablations in miniature (``benchmarks/ablations.py``: variants x seeds, held-out
  evaluation, Welch + Holm). Each finished run is saved as it ends under ``runs/figures/ablations/``; ``--parts I/N``
  runs a slice of what is left, so the hours it takes can be spent in parts. Writes ``docs/results.md``.

* ``alfworld`` -- the ALFWorld confirmatory study (``benchmarks/alfworld_confirm.py``: warm starts x RL seeds of the
  frozen demo preset, a permuted-reward and an equal-compute continued-SFT control, six task types on valid_seen /
  valid_unseen, the dev split). Each unit is saved as it ends under ``runs/figures/alfworld/``; ``--parts I/N`` runs
  a slice of what is left. Writes ``docs/alfworld_confirm.md``.
* ``stability`` -- how often the demo's RL fails a seed, per optimizer arm (``benchmarks/demo_stability.py``: SFT
  warm starts x RL seeds per arm at a stress lr, held-out evaluation, permutation tests + Holm). Each unit is saved
  as it ends under ``runs/figures/stability/``. Writes ``docs/demo_stability.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"  # what each committed figure was written from, shipped beside it
# per figure, the files its table is read from (globs under its run root); the demo's metrics keep these columns
SHIPPED = {"demo": ("seed*/demo_result.json", "seed*/sft_report.json", "seed*/metrics.jsonl"),
           "ablations": ("results/*.json", "warm_start.json", "settings.json", "sft_wall.json"),
           "alfworld": ("results/*.json", "settings.json"),
           "stability": ("results/*.json", "settings.json")}
METRIC_COLUMNS = ("update", "elapsed_s", "success_rate", "tool_call_rate", "tool_malformed_mean", "batch_size",
                  "num_admitted", "seq_kl_mean", "seq_kl_max", "grad_norm", "entropy_mean", "lr")


def stamp() -> str:
    """Commit (with ``+dirty`` when the tree has uncommitted changes to tracked files), UTC date, machine."""
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"commit {commit}, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu}, "
            f"{os.cpu_count()} cores, Python {platform.python_version()}")


def shown(path: Path) -> str:
    """A path as a report names it: relative to the repository when inside it (``docs/data/...``), else absolute."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def runs_root(args) -> Path:
    """``--runs``, else: reading only, the data shipped in ``docs/data`` (so a fresh clone regenerates every committed
    table); running, ``runs/figures``."""
    return Path(args.runs) if args.runs else (DATA if args.no_run else ROOT / "runs" / "figures")


def ship(figure: str, src: Path, seeds: list[int] | None = None) -> None:
    """Copy what ``figure``'s committed table was read from into ``docs/data/<figure>/`` (replacing what was there),
    so the table and its data travel together and ``--no-run`` regenerates it from a fresh clone."""
    dest = DATA / figure
    if src.resolve() == dest.resolve():
        return
    shutil.rmtree(dest, ignore_errors=True)
    wanted = None if seeds is None else {f"seed{s}" for s in seeds}
    for pattern in SHIPPED[figure]:
        for f in sorted(src.glob(pattern)):
            if wanted is not None and f.parent.name not in wanted:
                continue
            out = dest / f.relative_to(src)
            out.parent.mkdir(parents=True, exist_ok=True)
            if f.name == "metrics.jsonl":  # the columns the table and a reader of the run's course need
                rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
                out.write_text("".join(json.dumps({k: r[k] for k in METRIC_COLUMNS if k in r}) + "\n"
                                       for r in rows if "update" in r))
            else:
                shutil.copyfile(f, out)
    print(f"figures: its data -> {dest.relative_to(ROOT)}")


def run_demo_seed(run_dir: Path, seed: int, extra: list[str]) -> None:
    if run_dir.exists():  # an unfinished run: keep it for reading, start again
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.failed-{int(time.time())}"))
    cmd = [sys.executable, "-m", "agentenv.cli", "demo", "--no-progress", "--run-dir", str(run_dir),
           "--set", f"loop.seed={seed}", *extra]
    print(f"figures: {' '.join(cmd[2:])}", flush=True)
    with open(run_dir.parent / f"seed{seed}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)


def demo_rows(root: Path, seeds: list[int]) -> list[dict]:
    from agentenv.run.report import wilson_interval

    rows = []
    for seed in seeds:
        d = root / f"seed{seed}"
        res = json.loads((d / "demo_result.json").read_text())
        sft = json.loads((d / "sft_report.json").read_text()) if (d / "sft_report.json").exists() else {}
        split = next(iter(res["after"]))
        b, a = res["before"][split], res["after"][split]
        row = {"seed": seed, "split": split, "wall_min": res["wall_s"] / 60, "updates": res["updates"]}
        for when, ev in (("before", b), ("after", a)):
            k = int(ev.get("successes", round(ev["success_rate"] * ev["episodes"])))
            row[when] = {"success": ev["success_rate"], "ci": wilson_interval(k, ev["episodes"]),
                         "tool": ev.get("tool_call_rate", ev.get("tool_share", 0.0)), "n": ev["episodes"]}
        held = (sft.get("heldout") or [{}])[-1]
        row["sft_nll"] = {k: v["nll"] for k, v in held.items()}
        row["gate"] = gate_extremes(d / "metrics.jsonl")
        rows.append(row)
    return rows


def gate_extremes(metrics: Path) -> dict:
    """Over a run's updates: the fewest trajectories the trust gate admitted and the largest mean sequence KL of a
    batch -- where a run's policy drifted furthest from its samplers in one update."""
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "num_admitted" in r]
    if not recs:
        return {}
    worst = min(recs, key=lambda r: r["num_admitted"])
    return {"min_admitted": worst["num_admitted"], "batch": worst["batch_size"],
            "max_kl": max(r["seq_kl_mean"] for r in recs),
            "max_malformed": max(r.get("tool_malformed_mean", 0.0) for r in recs)}


def demo_table(rows: list[dict]) -> list[str]:
    def cell(x: dict) -> str:
        return f"{x['success']:.2f} [{x['ci'][0]:.2f}, {x['ci'][1]:.2f}] / {x['tool']:.2f}"

    n = rows[0]["before"]["n"]
    lines = [f"| seed | warm start (SFT): success [95% CI] / tool-call rate | after {rows[0]['updates']} RL updates "
             "| SFT held-out NLL per token (tool / guess) | gate: fewest admitted / peak KL | peak malformed calls "
             "| wall (min) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        nll, g = r["sft_nll"], r["gate"]
        gate = f"{g['min_admitted']} of {g['batch']} / {g['max_kl']:.3f}" if g else "-"
        lines.append(f"| {r['seed']} | {cell(r['before'])} | {cell(r['after'])} | "
                     f"{nll.get('tool', float('nan')):.3f} / {nll.get('guess', float('nan')):.3f} | {gate} | "
                     f"{g.get('max_malformed', float('nan')):.2f} | {r['wall_min']:.1f} |")
    after = [r["after"]["success"] for r in rows]
    tool = [r["after"]["tool"] for r in rows]
    if len(rows) > 1:
        lines.append(f"| mean ± sd | {statistics.mean(r['before']['success'] for r in rows):.2f} | "
                     f"{statistics.mean(after):.2f} ± {statistics.stdev(after):.2f} / "
                     f"{statistics.mean(tool):.2f} ± {statistics.stdev(tool):.2f} | | | | "
                     f"{statistics.mean(r['wall_min'] for r in rows):.1f} |")
    lines.append("")
    lines.append(f"Evaluated on the `{rows[0]['split']}` split: {n} questions from the held-out side of the demo's "
                 "question space (`agentenv.run.demo.is_heldout`), which no SFT demo or RL task is drawn from. Intervals: "
                 "Wilson, over the evaluation's episodes. Gate: over the run's updates, the fewest trajectories of a batch the "
                 "trust gate admitted and the largest batch-mean sequence KL (delta = 1e-3); peak malformed calls: the most "
                 "unparseable `<tool_call>` blocks per trajectory in one update (the tool-call format breaking; "
                 "0.3 over 3 updates raises the run's `TOOL-CALL FORMAT BREAKING` alarm).")
    return lines


def write_readme_block(name: str, lines: list[str]) -> None:
    """Replace what sits between ``<!-- figures:NAME ... -->`` and ``<!-- /figures:NAME -->`` in the README."""
    path = ROOT / "README.md"
    text = path.read_text()
    start = text.index(f"<!-- figures:{name}")
    start = text.index("-->", start) + len("-->")
    end = text.index(f"<!-- /figures:{name} -->", start)
    path.write_text(text[:start] + "\n" + "\n".join(lines).rstrip() + "\n" + text[end:])


def figure_demo(args) -> int:
    root = runs_root(args) / "demo"
    for seed in args.seeds:
        if not (root / f"seed{seed}" / "demo_result.json").exists():
            if args.no_run:
                print(f"figures: seed {seed} has no finished run in {root}; run without --no-run", file=sys.stderr)
                return 2
            root.mkdir(parents=True, exist_ok=True)
            run_demo_seed(root / f"seed{seed}", seed, args.extra)
            if not (root / f"seed{seed}" / "demo_result.json").exists():
                print(f"figures: the demo on seed {seed} did not finish; see {root}/seed{seed}.log", file=sys.stderr)
                return 1
    rows = demo_rows(root, args.seeds)
    saved = root / "notes.json"  # the notes belong to the runs they describe: kept with them, reused when not given
    notes = json.loads(saved.read_text()) if saved.exists() else {}
    args.note, args.note_short = args.note or notes.get("note", ""), args.note_short or notes.get("note_short", "")
    st = stamp()  # once, before this script writes (and so dirties) anything
    text = [f"# `agentenv demo` on seeds {', '.join(map(str, args.seeds))}", "",
            f"Generated by `python scripts/figures.py demo --seeds {' '.join(map(str, args.seeds))}` "
            f"({st}). Each row is a fresh `agentenv demo --set loop.seed=S`: its own SFT warm start, RL run and "
            "evaluations.", "", *demo_table(rows), ""]
    if args.note:
        text += [args.note, ""]
    out = Path(args.out or ROOT / "docs" / "demo.md")
    out.write_text("\n".join(text))
    if not args.out:
        ship("demo", root, args.seeds)
        if args.note or args.note_short:
            (DATA / "demo" / "notes.json").write_text(json.dumps({"note": args.note, "note_short": args.note_short},
                                                                 indent=1))
    if args.readme:
        write_readme_block("demo", [f"Measured by `scripts/figures.py` ({st}; details in [docs/demo.md](docs/demo.md)), "
                                    "held-out success [95% Wilson interval] / tool-call rate:", "",
                                    *demo_table(rows)[:-2], "", *( [args.note_short] if args.note_short else [])])
    print("\n".join(text))
    print(f"figures: wrote {out}")
    return 0


def flag_study(figure: str, script: str, doc: str, args) -> int:
    """A study whose own script does the work (resumable per run, ``--parts``, ``--report-only``); this only fixes
    where its runs and table live."""
    root = runs_root(args) / figure
    cmd = [sys.executable, script, "--root", shown(root), "--out", shown(args.out or ROOT / "docs" / doc), *args.study]
    cmd += ["--report-only"] if args.no_run else ["--parts", args.parts]
    return run_study(figure, root, cmd, args)


def figure_ablations(args) -> int:
    return flag_study("ablations", "benchmarks/ablations.py", "results.md", args)


def figure_stability(args) -> int:
    return flag_study("stability", "benchmarks/demo_stability.py", "demo_stability.md", args)


def figure_alfworld(args) -> int:
    """The study's own script does the work (resumable per unit); this only fixes where its units and report live."""
    root = runs_root(args) / "alfworld"
    cmd = [sys.executable, "benchmarks/alfworld_confirm.py", "report" if args.no_run else "run",
           "--root", shown(root), "--out", shown(args.out or ROOT / "docs" / "alfworld_confirm.md")]
    cmd += [] if args.no_run else ["--parts", args.parts, *args.study]
    return run_study("alfworld", root, cmd, args)


def run_study(figure: str, root: Path, cmd: list[str], args) -> int:
    out = ROOT / cmd[cmd.index("--out") + 1]  # paths in cmd are the repository's (shown): it runs there
    before = out.stat().st_mtime_ns if out.exists() else None
    print(f"figures: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.run(cmd, check=False, cwd=ROOT).returncode
    if not args.out and out.exists() and out.stat().st_mtime_ns != before:
        ship(figure, root)  # the report the docs hold was just written from these
    return rc


def study_parser(sub, name: str, what: str, out: str, study_help: str) -> None:
    """A long study's figure: its runs resume under --runs, --parts slices what is left, --no-run only reads."""
    a = sub.add_parser(name, help=f"{what} (resumable, in parts) -> {out}")
    a.add_argument("--runs", default=None, help="run root (resumable; default runs/figures, or docs/data with "
                   "--no-run)")
    a.add_argument("--parts", default="1/1", metavar="I/N", help="run the I-th of N slices of what is left")
    a.add_argument("--no-run", action="store_true", help="only read saved results")
    a.add_argument("--out", default=None, help=f"where to write the report (default {out})")
    a.add_argument("study", nargs=argparse.REMAINDER, help=f"after --: {study_help}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="figure", required=True)
    d = sub.add_parser("demo", help="agentenv demo on several seeds -> docs/demo.md")
    d.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    d.add_argument("--runs", default=None, help="run root (resumable; default runs/figures, or docs/data with "
                   "--no-run)")
    d.add_argument("--no-run", action="store_true", help="only read finished runs")
    d.add_argument("--out", default=None, help="where to write the table (default docs/demo.md)")
    d.add_argument("--note", default="", help="a line to print under the table (e.g. how loaded the machine was)")
    d.add_argument("--note-short", default="", help="the README's line under its copy of the table")
    d.add_argument("--no-readme", dest="readme", action="store_false", help="leave the README's table alone")
    d.add_argument("--set", dest="extra", action="append", default=[], type=lambda kv: f"--set={kv}",
                   help="an extra --set for every run")
    study_parser(sub, "ablations", "the ablation study", "docs/results.md", "benchmarks/ablations.py's own options "
                 "(--seeds, --only, --updates, ...)")
    study_parser(sub, "alfworld", "the ALFWorld confirmatory study", "docs/alfworld_confirm.md",
                 "benchmarks/alfworld_confirm.py run's own options (--warm-starts, --seeds, --samples, ...)")
    study_parser(sub, "stability", "the demo stability study", "docs/demo_stability.md",
                 "benchmarks/demo_stability.py's own options (--lr, --arms, --warm-starts, --max-hours, ...)")
    args = p.parse_args(argv)
    if getattr(args, "study", None) and args.study[0] == "--":
        args.study = args.study[1:]
    return {"demo": figure_demo, "ablations": figure_ablations, "alfworld": figure_alfworld,
            "stability": figure_stability}[args.figure](args)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
