"""How often the demo's RL fails a seed, and whether an optimizer setting prevents it: ``agentenv demo``'s
FlashREINFORCE from several SFT warm starts x RL seeds per arm, judged on held-out questions, compared by tests.

Why: at the preset's lr a rare run loses the tool-call format part-way (a grad-norm spike, then a KL excursion, then
the gate admits 1-2 of 32 for a few updates while the policy keeps degrading) and ends below the demo's target.
Too rare to count at the preset's lr in a session, so ``--lr`` (default 2e-4, twice the preset's) stresses every arm
alike: an arm that fails less under stress is the candidate, and is then rerun at the preset's lr
(``scripts/figures.py demo``) before the preset changes.

Units (each saved as ``ROOT/results/UNIT.json`` when it finishes; a rerun skips saved units, so the study runs in
parts, ``--parts I/N`` slicing what is left and ``--max-hours H`` starting no unit that would end past H hours):

* ``sft-kK`` (K = 0..``--warm-starts``-1): the demo's SFT warm start with ``loop.seed=K`` -- what
  ``agentenv demo --set loop.seed=K`` trains first -- under ``ROOT/work/sft-kK``.
* ``ARM-kK-sS`` (S = 1..``--seeds``): the demo's RL from warm start K (``sft.enabled=false``, ``loop.seed=S``,
  ``algo.lr=--lr``, the preset's updates and batch) with ``ARM``'s overrides (:data:`ARMS`), then the held-out
  evaluation of its final weights (``eval.episodes`` questions no SFT or RL step saw). Units are ordered seed-major
  and arms interleaved, so a partial study stays balanced across arms.

Outcome per run: held-out success and tool-call rate; **failed** when either misses the demo's per-seed target
(success >= 0.6 and tool-call rate >= 0.7, issue 39); from its metrics, whether the call format broke (the run log's
``TOOL-CALL FORMAT BREAKING`` alarm, ``malformed_call_alarm`` in its metrics), the peak malformed
blocks, the fewest rows the gate admitted and the peak mean sequence KL.

The report (``--out``, default ``docs/demo_stability.md``; :func:`write_report`, from the saved results only): per arm,
failures k/n with a Wilson interval, held-out success mean [t interval] and worst run, format breaks, the gate's
extremes; each arm against ``preset`` as a two-sided permutation test of the failure indicator (Holm across arms)
and of held-out success, and the fewest failures an arm would need for its test to pass at these run counts.
``ROOT/settings.json`` holds the design; a call with other options is refused rather than mixed in.

Power, in runs: at the default 4 x 3 = 12 runs per arm and two arms tested (Holm: each at 0.025), an arm with no
failure at all passes only if ``preset`` fails 6 of 12 or more (5 of 12 against 0 gives p 0.038): choose ``--lr``
so that the preset fails about half its runs, or test one arm. The report's "passes with at most" column states it.
Cost on 2 cores: a warm start ~4.5 min, an RL run with its evaluation ~3.5 min (~2.5 h for the defaults).
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO / "scripts"))
import demo_stability_report as report  # noqa: E402  (the sibling module, importable however this file is loaded)
from studies import one_design, parse_parts  # noqa: E402
from figures import shown, stamp  # noqa: E402  (scripts/figures.py: the stamp and paths every figure uses)

# arm -> --set overrides on top of the demo preset (and --lr)
ARMS: dict[str, list[str]] = {
    "preset": [],
    # the median pre-clip grad norm of the demo's updates is 0.25-0.37; the spikes before a collapse reached 1-3
    "clip0.3": ["algo.max_grad_norm=0.3"],
    # a coordinate whose gradient is usually tiny (a rare token's row) takes a step of ~lr / sqrt(v) times a spike:
    # a larger eps caps it. (No momentum, betas (0, 0.999), is not an arm: its one trial at lr 1.5e-4 went 0.24 -> 0.)
    "eps1e-5": ["algo.eps=1e-5"],
}
TARGET = {"success_rate": 0.6, "tool_call_rate": 0.7}  # the demo's per-seed target (issue 39)
DESIGN = ("warm_starts", "seeds", "lr", "arms", "smoke")
QUIET = ["run.tensorboard=false", "run.plot=false", "run.save_trajectories=false", "run.threads=2"]
SMOKE_SFT = ["sft.num_demos=8", "sft.epochs=1", "sft.batch_size=4", "model.name=tiny-bpe:64x2"]
SMOKE_RL = ["loop.total_updates=2", "loop.batch_size=4", "eval.episodes=4", "rollout.max_new_tokens=8",
            "env.num_tasks=16", "loop.num_workers=1", "loop.concurrency=2"]


def units(args) -> list[tuple[str, str | None]]:
    """Every unit in run order, each with the unit it needs (its warm start)."""
    ks = range(args.warm_starts)
    out: list[tuple[str, str | None]] = [(f"sft-k{k}", None) for k in ks]
    return out + [(f"{arm}-k{k}-s{s}", f"sft-k{k}") for s in range(1, args.seeds + 1) for k in ks for arm in args.arms]


def unit_sft(args, k: int, work: Path) -> dict:
    import torch

    from agentenv.core.config import load_config
    from agentenv.run.train import warm_start
    from agentenv.samplers.models import resolve_model

    cfg = load_config("demo", [], [f"loop.seed={k}", *(SMOKE_SFT if args.smoke else [])])
    torch.set_num_threads(2)
    path = warm_start(cfg, resolve_model(cfg.model.name).path, work / "sft_model", progress=False,
                      echo=lambda *_: None)
    held = (json.loads((work / "sft_report.json").read_text()).get("heldout") or [{}])[-1]
    return {"model": str(path), "sft_heldout_nll": {kind: v["nll"] for kind, v in held.items()}}


def outcome(res) -> dict:
    """What a finished RL run contributes (see the module docstring)."""
    ev, hist = res.evals[-1], res.history
    mal = [float(r.get("tool_malformed_mean") or 0.0) for r in hist]
    heldout = {k: ev.get(k) for k in ("success_rate", "tool_call_rate", "episodes", "successes")}
    return {"heldout": heldout, "failed": any(heldout[k] < v for k, v in TARGET.items()),
            "train": {"updates": len(hist), "format_broke": any(r.get("malformed_call_alarm") for r in hist),
                      "peak_malformed": max(mal, default=0.0),
                      "fewest_admitted": min((r["num_admitted"] for r in hist if "num_admitted" in r), default=None),
                      "peak_seq_kl": max((r["seq_kl_mean"] for r in hist if "seq_kl_mean" in r), default=None),
                      "batch_size": hist[-1].get("batch_size") if hist else None}}


def unit_rl(args, arm: str, k: int, seed: int, work: Path) -> dict:
    from agentenv.core.config import load_config
    from agentenv.run.train import run

    model = json.loads((Path(args.root) / "results" / f"sft-k{k}.json").read_text())["model"]
    sets = [f"model.name={model}", "sft.enabled=false", "eval.at_start=false", "eval.at_end=true",
            "eval.splits=[heldout]", f"loop.seed={seed}", f"algo.lr={args.lr}", f"run.dir={work / 'run'}", *QUIET,
            *ARMS[arm], *(SMOKE_RL if args.smoke else [])]
    cfg = load_config("demo", [], sets)
    res = run(cfg, progress=False, echo=lambda *_: None)
    if len(res.history) != cfg.loop.total_updates:
        raise RuntimeError(f"{arm}-k{k}-s{seed} stopped after {len(res.history)} of {cfg.loop.total_updates} updates")
    return {"arm": arm, "overrides": ARMS[arm], **outcome(res)}


def run_unit(args, name: str) -> dict:
    work = Path(args.root) / "work" / name
    if work.exists():  # an unfinished unit: start it again from scratch
        shutil.rmtree(work)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    if name.startswith("sft-"):
        k, seed = int(name.removeprefix("sft-k")), None
        out = unit_sft(args, k, work)
    else:  # ARM-kK-sS, where ARM may hold "-" (eps1e-5)
        arm, kk, ss = name.rsplit("-", 2)
        k, seed = int(kk[1:]), int(ss[1:])
        out = unit_rl(args, arm, k, seed, work)
    return {"unit": name, "kind": "sft" if seed is None else "rl", "k": k, "seed": seed,
            "wall_s": time.perf_counter() - t0, **out}


def load(root: Path) -> dict[str, dict]:
    return {r["unit"]: r for f in sorted((root / "results").glob("*.json")) for r in [json.loads(f.read_text())]}


def design(args, root: Path) -> None:
    """One root, one design (:func:`studies.one_design` over :data:`DESIGN`): a report takes the saved one."""
    vars(args).update(one_design(root, {k: getattr(args, k) for k in DESIGN}, study="demo_stability",
                                 report_only=args.report_only))


def study(args, root: Path) -> None:
    results = load(root)
    todo = [(u, need) for u, need in units(args) if u not in results]
    i, n = args.parts
    mine, t0 = todo[i - 1::n], time.perf_counter()
    print(f"demo_stability: {len(todo)} units left under {root}; this part runs {len(mine)}", flush=True)
    for j, (name, need) in enumerate(mine):
        if need and not (root / "results" / f"{need}.json").exists():
            print(f"  {name}: waits for {need} (another part)", flush=True)
            continue
        walls = [r["wall_s"] for r in load(root).values() if r["kind"] == ("sft" if name.startswith("sft") else "rl")]
        guess = sum(walls) / len(walls) if walls else 0.0
        if args.max_hours is not None and time.perf_counter() - t0 + guess > args.max_hours * 3600:
            print(f"demo_stability: stopping before {name} (~{guess / 60:.0f} min): it would end past --max-hours "
                  f"{args.max_hours:g}; {len(mine) - j} units of this part left, run again to go on", flush=True)
            break
        r = run_unit(args, name)
        (root / "results" / f"{name}.json").write_text(json.dumps(r, indent=1))
        h = r.get("heldout")
        print(f"  {name}: {r['wall_s']:.0f}s" + (f"  held-out success {h['success_rate']:.2f}, tool "
                                                 f"{h['tool_call_rate']:.2f}{'  FAILED' if r['failed'] else ''}"
                                                 if h else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=None, help="study root (default runs/demo_stability; smoke: a temporary dir)")
    p.add_argument("--warm-starts", type=int, default=4, help="SFT warm starts (loop.seed 0..K-1)")
    p.add_argument("--seeds", type=int, default=3, help="RL seeds per warm start and arm")
    p.add_argument("--lr", type=float, default=2e-4, help="RL learning rate of every arm (the preset's is 1e-4)")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms ('preset' first)")
    p.add_argument("--parts", type=parse_parts, default=(1, 1), metavar="I/N", help="run the I-th of N slices")
    p.add_argument("--max-hours", type=float, default=None, help="start no unit that would end past H hours")
    p.add_argument("--out", default=None, help="report path (default docs/demo_stability.md; smoke: ROOT/...)")
    p.add_argument("--report-only", action="store_true", help="run nothing: write the report from saved results")
    p.add_argument("--smoke", action="store_true", help="1 warm start x 1 seed, tiny SFT, 2 updates, 4 questions")
    args = p.parse_args(argv)
    if args.arms[0] != "preset":
        p.error("--arms: the first arm is the baseline every other is tested against: 'preset'")
    if args.smoke:
        args.warm_starts, args.seeds = 1, 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    command = ("python benchmarks/demo_stability.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    root = Path(args.root or (tempfile.mkdtemp(prefix="stability-smoke-") if args.smoke
                              else REPO / "runs" / "demo_stability"))
    args.root = str(root)
    if not args.report_only:  # a report reads; it makes no directories
        (root / "results").mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (root / "demo_stability.md" if args.smoke
                                           else REPO / "docs" / "demo_stability.md")
    design(args, root)
    if not args.report_only:
        study(args, root)
    res = {u: r for u, r in load(root).items() if r["kind"] == "rl"}
    if not res:  # an empty report would overwrite one that has results
        print(f"demo_stability: no saved runs under {root}/results: nothing to report, {out} left as it is",
              file=sys.stderr)
        return 2 if args.report_only else 0
    print(write_report(root, out, vars(args), command=command))
    return 0


def write_report(root: Path, out: Path, s: dict, *, command: str) -> str:
    lines = ["# The demo's stability: how often a seed fails, per optimizer arm", "",
             f"_Generated by `{command}` ({stamp()}) from the saved results under `{shown(root)}`. Do not edit by "
             "hand._" + (" **SMOKE RUN: numbers mean nothing.**" if s.get("smoke") else ""), "",
             *report.report_lines(load(root), s)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
