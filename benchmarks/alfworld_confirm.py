"""The ALFWorld confirmatory study: does FlashREINFORCE on the frozen ``alfworld_demo`` preset beat its own warm start
by more than its two controls do? Several warm starts x RL seeds, every model evaluated on all six task types.

    python benchmarks/alfworld_confirm.py run [--root DIR] [--parts I/N]   # what is left (resumable, in parts)
    python benchmarks/alfworld_confirm.py report [--root DIR] [--out docs/alfworld_confirm.md]   # saved results only
    python benchmarks/alfworld_confirm.py run --smoke                      # the whole code path in under a minute

Units (each one's result is ``ROOT/results/UNIT.json``, written when it finishes; a rerun skips finished units and
restarts unfinished ones from scratch; ``--parts I/N`` runs the I-th of N interleaved slices of what is left, and a
unit whose warm start another part has not finished yet waits for a later call):

* ``sft-kK`` (K = 1..``--warm-starts``): the preset's SFT warm start with ``loop.seed=K`` (demo order and the
  held-out demos; the tiny model's initial weights are the preset's, fixed), saved under ``ROOT/work/sft-kK``.
* ``warm-kK``: that warm start's evaluation (``--warm-samples`` plays per game: every arm of K is paired with it).
* ``rl-kK-sS`` (S = 1..``--seeds``): the preset's RL from warm start K (``sft.enabled=false``, ``loop.seed=S``,
  ``--updates`` updates, the dev games held out of its task pool), then its final (tail-averaged) weights evaluated.
* ``perm-kK-sS``: the same with ``algo.permute_rewards=true``: the permuted-reward control (same rewards, no link to
  behaviour).
* ``csft-kK``: the equal-compute continued-SFT control: from warm start K, as many optimizer steps as RL takes
  (``--updates``) of as many sequences (the preset's ``loop.batch_size``), i.e. ``updates x batch`` scripted demos
  of the preset's SFT set (drawn once, seeded by K, without replacement), one epoch, at RL's optimizer settings
  (``algo.lr``, schedule, weight decay, grad clip; warmup ``algo.warmup_ratio`` of the steps) and SFT's loss (the
  preset's ``sft.context_loss_weight``). Only the training signal differs from RL: demos, not its own rewarded plays.
* ``rewarm-kK`` (only when needed): a unit whose warm start's model is not under ``ROOT/work`` (a part on another
  machine, a lost work directory) first trains that SFT again (:func:`rebuild_warm_start`). Training is not bitwise
  reproducible across machines: a remake whose held-out NLL is not the original's is another warm start of the same
  recipe, evaluated once as ``rewarm-kK``; the runs from it pair with that, not with ``warm-kK``.

Evaluation of every model: ``valid_seen`` and ``valid_unseen`` of the full json_2.1.1 games (``$ALFWORLD_DATA``,
else the archive ``--archive`` unpacked once into the agentenv cache), the preset's env settings and turn limit
otherwise: the preset's two task types (90 of the 274 games: the confirmatory endpoint) at ``--warm-samples`` /
``--samples`` plays per game, and the other four types (184 games, which no model here trains on) at
``--other-samples`` plays per game, so all six types are reported, zeros included; and the ``dev`` split
(``env.kwargs.dev_games`` train games of the preset's two types, held out of RL's pool -- 112 of the 128 shipped
games remain for RL at the default 16 -- and the only split a preset may be tuned on; the SFT demos do cover them, as
they cover every train game of the two types). The report (:mod:`alfworld_confirm_report`) pairs every arm with its
own warm start game by game, with an interval over warm starts, then seeds, then games.

Cost at the defaults (3 warm starts x 3 seeds, 48 updates; 3 x (90 x 8 + 184) + 21 x (90 x 4 + 184) + 24 x 16 dev
games x 8 = 17,200 evaluation episodes): the report's cost table gives each kind of unit's measured wall time and what
the units left would take. On 2 cores the first 13 units took SFT ~9 min, a warm start's evaluation ~6 min, an RL or
permuted-reward run with its evaluation 10-16 min: about 5 hours in all, best spent as ``--parts`` on several
machines, or as session-sized runs (``--max-hours H`` starts no unit that would end past H hours; the unit it stops
before waits for the next call).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import alfworld_confirm_report as report  # noqa: E402  (the sibling module, importable however this file is loaded)
from studies import parse_parts  # noqa: E402

from agentenv.envs.alfworld_data import TASK_TYPES  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PRESET = "alfworld_demo"
ARCHIVE = REPO.parent / "shared" / "data" / "alfworld" / "alfworld-json_2.1.1.tar.xz"
SAME_NLL = 1e-3  # a remade warm start within this held-out NLL of the original's is the same model (rounding only)
QUIET = ["run.tensorboard=false", "run.plot=false", "run.save_trajectories=false"]
# the smoke trains one task type, so that the shipped games (the preset's two types) hold an "other" type to evaluate
SMOKE = ["loop.batch_size=2", "loop.concurrency=2", "eval.episodes=2", "env.num_tasks=4", "run.threads=2",
         "env.kwargs.task_types=[pick_and_place]"]
SMOKE_SFT = ["model.name=tiny-bpe-alfworld:64x2", "sft.num_demos=8", "sft.epochs=1", "sft.batch_size=4",
             "sft.heldout_demos=2"]


def six_type_data(args) -> str:
    """The data root for the six-type evaluation: the shipped games in a smoke, else $ALFWORLD_DATA, else the archive
    unpacked once into the agentenv cache."""
    if args.smoke:
        return "builtin:demo"
    if os.environ.get("ALFWORLD_DATA"):
        return os.environ["ALFWORLD_DATA"]
    from agentenv.core.cache import atomic_dir, cache_dir

    target = cache_dir() / "alfworld-json_2.1.1"
    if (target / "json_2.1.1").is_dir():
        return str(target)
    if not Path(args.archive).is_file():
        sys.exit(f"alfworld_confirm: no ALFWorld games for the six-type evaluation: set $ALFWORLD_DATA to an unpacked "
                 f"json_2.1.1 root or pass --archive PATH/alfworld-json_2.1.1.tar.xz (not found: {args.archive})")

    def unpack(out: Path) -> None:
        with tarfile.open(args.archive, "r:xz") as tar:
            tar.extractall(out, filter="data")

    print(f"alfworld_confirm: unpacking {args.archive} into {target} (once)", flush=True)
    return str(atomic_dir(target, unpack))


def config(args, sets: list[str]):
    from agentenv.core.config import load_config

    return load_config(PRESET, [], [*QUIET, *(SMOKE if args.smoke else []), *sets])


def evaluate_model(args, model_dir: str, work: Path, plays: int) -> dict:
    """``model_dir`` on valid_seen + valid_unseen and on dev: ``{split: evaluation}``. valid_seen and valid_unseen are
    played twice: on the preset's task types at ``plays`` per game (``{split}``), and on the other task types at
    ``--other-samples`` per game (``{split}_other``; the report joins the two for its six-type rows). The preset never
    trains on the other types, so they are reported (zeros included) at the fewest plays that show a change there:
    they hold two thirds of the games and most of the evaluation's time (lost 12-turn episodes)."""
    from agentenv.run.train import run

    trained = preset_types(args)
    others = [t for t in TASK_TYPES.values() if t not in trained]
    common = [f"model.name={model_dir}", "sft.enabled=false", "eval.at_start=false", "eval.at_end=false"]
    valid = [f"env.kwargs.data_dir={args.data}", "eval.splits=[valid_seen, valid_unseen]"]
    evals = {}
    for sets, suffix in (
            (valid + [f"env.kwargs.task_types=[{', '.join(trained)}]", f"eval.samples={plays}",
                      f"run.dir={work / 'eval_valid'}"], ""),
            (valid + [f"env.kwargs.task_types=[{', '.join(others)}]", f"eval.samples={args.other_samples}",
                      f"run.dir={work / 'eval_other'}"], "_other"),
            ([f"env.kwargs.dev_games={args.dev_games}", "eval.splits=[dev]", f"eval.samples={args.dev_samples}",
              f"run.dir={work / 'eval_dev'}"], "")):
        res = run(config(args, common + sets), eval_only=True, progress=False, echo=lambda *_: None)
        evals.update({e["split"] + suffix: {k: v for k, v in e.items() if k != "policy_versions"} for e in res.evals})
    return evals


def preset_types(args) -> list[str]:
    """The task types the preset (as the study runs it) trains and plays: the study's confirmatory games."""
    return list(config(args, []).env.kwargs["task_types"])


def unit_sft(args, k: int, work: Path) -> dict:
    from agentenv.run.train import warm_start
    from agentenv.samplers.models import resolve_model

    cfg = config(args, [f"loop.seed={k}", *(SMOKE_SFT if args.smoke else [])])
    warm_start(cfg, resolve_model(cfg.model.name).path, work / "sft_model", progress=False, echo=lambda *_: None)
    sft = json.loads((work / "sft_report.json").read_text())
    return {"model": str(work / "sft_model"), "sft": {k: sft.get(k) for k in ("steps", "demos", "epochs", "heldout")}}


def unit_warm(args, k: int, work: Path) -> dict:
    return {"evals": evaluate_model(args, model_of(args, k), work, args.warm_samples)}


def unit_rl(args, k: int, seed: int, work: Path, permute: bool) -> dict:
    from agentenv.run.train import run

    sets = [f"model.name={model_of(args, k)}", "sft.enabled=false", f"loop.seed={seed}",
            f"env.kwargs.dev_games={args.dev_games}", f"loop.total_updates={args.updates}", "eval.at_start=false",
            "eval.at_end=false", f"run.dir={work / 'run'}", *(["algo.permute_rewards=true"] if permute else [])]
    res = run(config(args, sets), progress=False, echo=lambda *_: None)
    if len(res.history) != args.updates:
        raise RuntimeError(f"the RL run stopped after {len(res.history)} of {args.updates} updates")
    third = max(1, len(res.history) // 3)
    succ = [float(r.get("success_rate", 0.0)) for r in res.history]
    train = {"updates": len(res.history), "success_first_third": sum(succ[:third]) / third,
             "success_last_third": sum(succ[-third:]) / third,
             "rewards_permuted": all(r.get("rewards_permuted") == 1 for r in res.history)}
    if train["rewards_permuted"] != permute:
        raise RuntimeError(f"the run's metrics say rewards_permuted={train['rewards_permuted']}, wanted {permute}")
    final = str(work / "run" / "final_model")
    return {"model": final, "train": train, "evals": evaluate_model(args, final, work, args.samples)}


def unit_csft(args, k: int, work: Path) -> dict:
    """The equal-compute continued-SFT control (the module docstring); its definition is recorded with the result."""
    import torch
    from agentenv.core.trajectory import iter_jsonl
    from agentenv.run.sft import SFTConfig, demos_path, load_model_and_tokenizer, prepare_demos, save_checkpoint_dir
    from agentenv.run.sft import train_sft

    cfg = config(args, [])
    a, steps, batch = cfg.algo, args.updates, cfg.loop.batch_size
    model, tok, _ = load_model_and_tokenizer(model_of(args, k))
    pool = prepare_demos(list(iter_jsonl(demos_path(cfg.sft.demos))), tok, only_successful=cfg.sft.only_successful,
                         max_tokens=cfg.rollout.max_total_tokens)
    if len(pool) < steps * batch:
        raise RuntimeError(f"{len(pool)} demos for {steps} steps x {batch}: fewer than one epoch needs")
    demos = random.Random(1000 + k).sample(pool, steps * batch)
    sft = SFTConfig(epochs=1, lr=a.lr, batch_size=batch, weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm,
                    warmup_steps=max(1, round(a.warmup_ratio * steps)), schedule=a.schedule,
                    min_lr_ratio=a.min_lr_ratio,
                    seed=1000 + k, only_successful=cfg.sft.only_successful, max_tokens=cfg.rollout.max_total_tokens,
                    context_loss_weight=cfg.sft.context_loss_weight)
    torch.set_num_threads(cfg.run.threads or torch.get_num_threads())
    r = train_sft(model, demos, sft, progress=False, echo=lambda *_: None)
    if r["steps"] != steps:
        raise RuntimeError(f"continued SFT took {r['steps']} steps, not RL's {steps}")
    out = save_checkpoint_dir(model, tok, work / "csft_model")
    return {"model": str(out), "train": {"steps": r["steps"], "sequences": steps * batch, "lr": a.lr,
                                         "schedule": a.schedule, "loss_last": r["loss_last"]},
            "evals": evaluate_model(args, str(out), work, args.samples)}


def model_of(args, k: int) -> str:
    return str(Path(args.root) / "work" / f"sft-k{k}" / "sft_model")


def model_here(args, sft_unit: str) -> bool:
    """Whether the model of ``sft-kK`` is under this root (else a unit from it remakes it first)."""
    return Path(model_of(args, int(sft_unit.split("-k")[1])), "config.json").is_file()


def heldout_drift(a: dict, b: dict) -> float:
    """How far two SFT runs' models are apart: the largest gap in held-out NLL after an epoch (inf if they differ in
    steps or demos)."""
    if (a["steps"], a["demos"], len(a["heldout"])) != (b["steps"], b["demos"], len(b["heldout"])):
        return float("inf")
    return max((abs(x["all"]["nll"] - y["all"]["nll"]) for x, y in zip(a["heldout"], b["heldout"])), default=0.0)


def rebuild_warm_start(args, k: int) -> dict | None:
    """Warm start K's model, remade when its SFT finished but the model is not here (another machine ran it, or its
    work directory was lost). Training is not bitwise reproducible across machines and library versions, so the
    remade model is checked against the original by held-out NLL after each epoch. If it matches (within
    :data:`SAME_NLL`), the arms still pair with ``warm-kK``; if not, it is another warm start of the same recipe, and
    the arms that start from it pair with its own evaluation, ``rewarm-kK`` (the report compares their changes with
    those of the runs from the original). A model remade once more must match the first remake: ``rewarm-kK`` and the
    runs paired with it were made from that one. Returns what the remake found (kept with every unit that uses it),
    None for the original model."""
    work, results = Path(model_of(args, k)).parent, Path(args.root) / "results"
    marker = work / "rebuilt.json"
    if model_here(args, f"sft-k{k}"):
        return json.loads(marker.read_text()) if marker.is_file() else None
    saved = json.loads((results / f"sft-k{k}.json").read_text())["sft"]
    first = results / f"rewarm-k{k}.json"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"alfworld_confirm: warm start {k}'s model is not under {work}: running its SFT again", flush=True)
    t0 = time.perf_counter()
    again = unit_sft(args, k, work)["sft"]
    drift = heldout_drift(saved, again)
    if first.is_file():
        off = heldout_drift(json.loads(first.read_text())["warm_start"]["sft"], again)
        if off > SAME_NLL:
            shutil.rmtree(work)
            sys.exit(f"alfworld_confirm: warm start {k} remade again differs from its first remake (held-out NLL off "
                     f"by {off:.2g}), which rewarm-k{k} evaluated and runs were paired "
                     f"with: run what is left of warm start {k} where that model is, or start a new --root")
        baseline = first.stem
    else:  # before warm-kK is saved, warm-kK itself evaluates the remade model
        same = drift <= SAME_NLL or not (results / f"warm-k{k}.json").is_file()
        baseline = f"warm-k{k}" if same else f"rewarm-k{k}"
    found = {"rebuilt": True, "heldout_nll_drift": drift, "baseline": baseline, "wall_s": time.perf_counter() - t0,
             "sft": {key: again[key] for key in ("steps", "demos", "heldout")}}
    marker.write_text(json.dumps(found, indent=1))
    print(f"alfworld_confirm: warm start {k} remade in {found['wall_s']:.0f}s, held-out NLL {drift:.2g} from the "
          f"original's: its arms pair with {baseline}", flush=True)
    return found


def units(args) -> list[tuple[str, str | None]]:
    """Every unit in run order, with the unit it needs (its warm start's SFT)."""
    ks, seeds = range(1, args.warm_starts + 1), range(1, args.seeds + 1)
    out: list[tuple[str, str | None]] = [(f"sft-k{k}", None) for k in ks]
    out += [(f"warm-k{k}", f"sft-k{k}") for k in ks]
    out += [(f"{arm}-k{k}-s{s}", f"sft-k{k}") for k in ks for s in seeds for arm in ("rl", "perm")]
    return out + [(f"csft-k{k}", f"sft-k{k}") for k in ks]


def run_unit(args, name: str) -> dict:
    kind, *rest = name.split("-")
    k = int(rest[0][1:])
    seed = int(rest[1][1:]) if len(rest) > 1 else None
    remade = None if kind == "sft" else rebuild_warm_start(args, k)
    if remade and kind not in ("warm", "rewarm") and not (Path(args.root) / "results" / f"{remade['baseline']}.json"
                                                          ).is_file():
        save_unit(args, remade["baseline"])  # the remade warm start's own evaluation, before any arm from it
    work = Path(args.root) / "work" / name
    if work.exists():  # an unfinished unit: start it again from scratch
        shutil.rmtree(work)
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    if kind == "sft":
        out = unit_sft(args, k, work)
    elif kind in ("warm", "rewarm"):
        out = unit_warm(args, k, work)
    elif kind in ("rl", "perm"):
        out = unit_rl(args, k, seed, work, permute=kind == "perm")
    else:
        out = unit_csft(args, k, work)
    return {"unit": name, "kind": kind, "k": k, "seed": seed, "wall_s": time.perf_counter() - t0, **out,
            **({"warm_start": remade} if remade else {})}


def save_unit(args, name: str) -> None:
    r = run_unit(args, name)
    (Path(args.root) / "results" / f"{name}.json").write_text(json.dumps(r, indent=1))
    print(f"  {name}: {r['wall_s']:.0f}s  " + "  ".join(
        f"{s} {e['successes']}/{e['episodes']}" for s, e in r.get("evals", {}).items()), flush=True)


def study(args) -> int:
    results = Path(args.root) / "results"
    results.mkdir(parents=True, exist_ok=True)
    path, now = Path(args.root) / "settings.json", settings(args)
    if path.exists():  # one study, one design: parts run elsewhere or later must not mix in other settings
        was = json.loads(path.read_text())
        differ = sorted(k for k in now if k != "data" and was.get(k) != now[k])
        if differ:
            sys.exit(f"alfworld_confirm: {args.root} holds a study with other settings ("
                     + ", ".join(f"{k}: {was.get(k)} there, {now[k]} here" for k in differ)
                     + "): pass the same options, or another --root")
    path.write_text(json.dumps(now, indent=2))
    todo = [(u, need) for u, need in units(args) if not (results / f"{u}.json").exists()]
    i, n = args.parts
    mine = todo[i - 1::n]
    # this part's units whose warm start's model is here go first: a remade one costs an SFT and an evaluation
    mine.sort(key=lambda t: bool(t[1]) and not model_here(args, t[1]))
    print(f"alfworld_confirm: {len(todo)} units left under {args.root}; this part runs {len(mine)}", flush=True)
    waiting, t0 = [], time.perf_counter()
    for j, (name, need) in enumerate(mine):
        if need and not (results / f"{need}.json").exists():
            waiting.append(name)
            continue
        if args.max_hours is not None:
            left = args.max_hours * 3600 - (time.perf_counter() - t0)
            saved = report.load(Path(args.root))
            guess = report.mean_wall(saved, name.split("-")[0])
            if need and not model_here(args, need):
                # its warm start is remade first, and evaluated again unless it comes out the same
                guess = (guess or 0) + sum(report.mean_wall(saved, kind) or 0 for kind in ("sft", "warm"))
            if left < (guess or 0) or left <= 0:
                print(f"alfworld_confirm: stopping before {name} (~{(guess or 0) / 60:.0f} min, going by the saved "
                      f"units of its kind): it would end past --max-hours {args.max_hours:g}; "
                      f"{len(mine) - j} units of this part left, run again to go on", flush=True)
                break
        save_unit(args, name)
    if waiting:
        print(f"alfworld_confirm: {len(waiting)} units wait for a warm start another part has not finished: "
              f"{', '.join(waiting)}; run again when it has", flush=True)
    return 0


def settings(args) -> dict:
    return {k: getattr(args, k) for k in ("warm_starts", "seeds", "updates", "dev_games", "warm_samples", "samples",
                                          "other_samples", "dev_samples", "smoke", "data")} | {
        "preset_types": preset_types(args)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="run what is left of the study (resumable)")
    r.add_argument("--root", default=None, help="study root (default runs/alfworld_confirm)")
    r.add_argument("--parts", type=parse_parts, default=(1, 1), metavar="I/N", help="run the I-th of N slices")
    r.add_argument("--warm-starts", type=int, default=3)
    r.add_argument("--seeds", type=int, default=3, help="RL seeds per warm start")
    r.add_argument("--updates", type=int, default=None, help="RL updates (default: the preset's)")
    r.add_argument("--dev-games", type=int, default=16, help="train games held out of RL as the dev split")
    r.add_argument("--warm-samples", type=int, default=8, help="plays per game of each warm start's evaluation")
    r.add_argument("--samples", type=int, default=4, help="plays per game of each trained model's evaluation")
    r.add_argument("--other-samples", type=int, default=1,
                   help="plays per game of the task types the preset does not train (every model)")
    r.add_argument("--dev-samples", type=int, default=8, help="plays per dev game")
    r.add_argument("--max-hours", type=float, default=None,
                   help="start no unit that would end past this many hours (by the saved units' times)")
    r.add_argument("--archive", default=str(ARCHIVE), help="alfworld-json_2.1.1.tar.xz (when $ALFWORLD_DATA is unset)")
    r.add_argument("--smoke", action="store_true", help="tiny model, 1 warm start x 1 seed, 2 updates, shipped games")
    p = sub.add_parser("report", help="write the report from the saved results only")
    p.add_argument("--root", default=None, help="study root (default runs/alfworld_confirm)")
    for q in (r, p):
        q.add_argument("--out", default=None, help="report path (default docs/alfworld_confirm.md; smoke: ROOT/...)")
    # the command line, read before anything runs: an imported game library may rewrite sys.argv
    command = ("python benchmarks/alfworld_confirm.py " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.mode == "run" and args.smoke:
        args.warm_starts, args.seeds, args.updates, args.dev_games = 1, 1, 2, 4
        args.warm_samples = args.samples = args.other_samples = args.dev_samples = 1
    args.root = args.root or str(REPO / "runs" / "alfworld_confirm")
    if args.mode == "run":
        if min(args.warm_starts, args.seeds, args.dev_games, args.warm_samples, args.samples, args.other_samples,
               args.dev_samples) < 1:
            ap.error("--warm-starts, --seeds, --dev-games and the plays per game must be >= 1")
        args.updates = args.updates or config(args, []).loop.total_updates
        args.data = six_type_data(args)
        study(args)
    out = Path(args.out) if args.out else (Path(args.root) / "alfworld_confirm.md" if getattr(args, "smoke", False)
                                           else REPO / "docs" / "alfworld_confirm.md")
    if not report.load(Path(args.root)):  # an empty report would overwrite the one that has results
        print(f"alfworld_confirm: no saved units under {args.root}/results: nothing to report, {out} left as it is "
              "(run the study, or pass the --root that holds it)", file=sys.stderr)
        return 2 if args.mode == "report" else 0
    print(report.write(Path(args.root), out, command=command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
