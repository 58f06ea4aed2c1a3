"""The ALFWorld confirmatory study's report, from saved results only: ``ROOT/results/*.json`` (one per finished unit of
``benchmarks/alfworld_confirm.py``) -> markdown (``docs/alfworld_confirm.md``), stamped with commit, UTC date and
machine (``scripts/figures.py``'s :func:`stamp`).

Contract:

* Per split (valid_seen and valid_unseen: the preset's task types, then all six; dev: the tuning split) and per
  arm (RL, permuted rewards, continued SFT): the change against the arm's OWN warm start, paired game by game --
  mean over warm starts of the mean over their runs of the mean over games of (after rate - before rate) -- with a
  95% bootstrap interval over warm starts, then runs, then games (:func:`agentenv.run.report.nested_paired_test`);
  and RL against each control directly, paired by warm start (and seed, for the permuted arm) and game; a run
  from a remade warm start (a lost model trained again elsewhere, not bitwise the original) pairs with that model's
  own evaluation, and RL vs a control that started elsewhere compares their changes (:func:`arm_groups`). The
  baseline and arm columns are weighted as the change is (:func:`nested_paired_test`), so arm - baseline = change.
* Per task type (all six, zeros shown; a type with no games in the split says so): pooled successes / episodes of
  every warm start and of every arm.
* The result first (:func:`result_lines`): RL against its warm start and each control on the preset's task types of
  valid_seen and valid_unseen, as bootstrap tests Holm-adjusted across them, with each one's MDE and a verdict.
* A study with units still missing says so at the top: a partial report cannot read as the whole study.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from statistics import NormalDist

from agentenv.envs.alfworld_data import TASK_TYPES
from agentenv.core.stats import holm
from agentenv.run.report import nested_paired_test

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from figures import shown, stamp  # noqa: E402  (scripts/figures.py: the stamp and paths every figure uses)

ARMS = (("rl", "RL (FlashREINFORCE)"), ("perm", "RL, permuted rewards"), ("csft", "continued SFT, equal compute"))
SPLITS = ("valid_seen", "valid_unseen", "dev")
# The confirmatory family (the preset's task types on the two held-out splits): RL against its warm start and each
# control. dev is the tuning split and the six-type rows are secondary: neither is in it.
PRIMARY = [(split, label, base) for split in ("valid_seen", "valid_unseen")
           for label, base in (("RL vs its warm start", "warm"), ("RL vs permuted rewards", "perm"),
                               ("RL vs continued SFT", "csft"))]
ALPHA, POWER = 0.05, 0.8


def load(root: Path) -> dict[str, dict]:
    return {r["unit"]: r for f in sorted((root / "results").glob("*.json")) for r in [json.loads(f.read_text())]}


def counts(unit: dict, split: str) -> dict | None:
    """Per game ``[successes, plays]`` of ``split``: ``valid_seen`` / ``valid_unseen`` are the preset's task types,
    and ``valid_seen+other`` etc. add the other types' evaluation (games keyed apart: each evaluation numbers its
    own)."""
    evals = unit.get("evals") or {}
    split, _, other = split.partition("+")
    parts = [evals.get(split)] + ([evals.get(f"{split}_other")] if other else [])
    if not all(parts):
        return None
    return {f"{i}:{g}": c for i, ev in enumerate(parts) for g, c in ev["task_successes"].items()}


def baseline_of(res: dict[str, dict], unit: dict) -> dict | None:
    """The evaluation of the model ``unit`` started from: its warm start's, or, for a run from a remade warm start
    that is not the original (:func:`alfworld_confirm.rebuild_warm_start`), the remade model's own."""
    return res.get((unit.get("warm_start") or {}).get("baseline") or f"warm-k{unit['k']}")


def arm_groups(res: dict[str, dict], arm: str, split: str, baseline: str = "warm") -> list[list[tuple]]:
    """Per warm start k: ``[(before, after), ...]`` of ``arm``'s runs, each paired with its ``baseline``: the
    evaluation of the model it started from (:func:`baseline_of`), or for RL vs a control the control run of the same
    k and seed (else of the same k). A control that started from another model than the RL run (a remade warm start)
    enters as its change carried onto the RL run's start, so RL vs control compares their changes."""
    groups: dict[int, list] = {}
    for u in res.values():
        start = baseline_of(res, u)
        if u["kind"] != arm or counts(u, split) is None or start is None or counts(start, split) is None:
            continue
        if baseline == "warm":
            before = counts(start, split)
        else:
            ctrl = res.get(f"{baseline}-k{u['k']}" if baseline == "csft" else f"{baseline}-k{u['k']}-s{u['seed']}")
            ctrl_start = ctrl and baseline_of(res, ctrl)
            if ctrl is None or counts(ctrl, split) is None or ctrl_start is None or counts(ctrl_start, split) is None:
                continue
            before = counts(ctrl, split) if ctrl_start is start else [
                (1, counts(ctrl, split)), (-1, counts(ctrl_start, split)), (1, counts(start, split))]
        groups.setdefault(u["k"], []).append((before, counts(u, split)))
    return [groups[k] for k in sorted(groups)]


def remade_lines(res: dict[str, dict]) -> list[str]:
    """Which runs started from a remade warm start that is not the original, and how they are paired."""
    remade = sorted({(u["k"], u["warm_start"]["baseline"], u["warm_start"]["heldout_nll_drift"]) for u in res.values()
                     if (u.get("warm_start") or {}).get("baseline", "").startswith("rewarm")})
    if not remade:
        return []
    runs = {k: sorted(u["unit"] for u in res.values() if u["kind"] != "rewarm"
                      and (u.get("warm_start") or {}).get("baseline") == base) for k, base, _ in remade}
    return ["**Remade warm starts.** A warm start's model was lost and its SFT run again on another machine; training "
            "is not bitwise reproducible across machines, so the remake is another warm start of the same recipe. "
            "The runs from it are paired with its own evaluation (`rewarm-kK`, at the warm starts' plays per game), "
            "and RL against a control from it compares the two runs' changes from their own starts:", "",
            *(f"- warm start {k}: held-out NLL {d:.3f} from the original's; evaluated as `{base}`; runs from it: "
              f"{', '.join(runs[k]) or 'none yet'}" for k, base, d in remade), ""]


def change_row(label: str, groups: list) -> str:
    runs = sum(len(g) for g in groups)
    if not runs:
        return f"| {label} | 0 | | | not run yet |"
    try:
        t = nested_paired_test(groups)
        means = f"{t['before']:.3f} | {t['after']:.3f}"
        cell = f"**{t['change']:+.3f}** [{t['low']:+.3f}, {t['high']:+.3f}] over {t['tasks']} games"
    except ValueError as e:
        means, cell = " | ", f"n/a ({e})"
    sizes = [len(g) for g in groups]  # K x S when every warm start has as many runs; else each one's count
    shape = f"{len(groups)} x {sizes[0]}" if len(set(sizes)) == 1 else f"{len(groups)}: {'+'.join(map(str, sizes))}"
    return f"| {label} | {shape} | {means} | {cell} |"


def change_table(res: dict[str, dict], split: str, title: str) -> list[str]:
    lines = [f"**{title}**", "", "| arm (vs its baseline) | warm starts x runs | baseline success | arm success "
             "| change = arm - baseline, paired by game [95% CI: warm starts, runs, games] |",
             "| --- | --- | --- | --- | --- |"]
    for arm, label in ARMS:
        lines.append(change_row(f"{label} vs its warm start", arm_groups(res, arm, split)))
    lines.append(change_row("RL vs permuted rewards (same warm start and seed)", arm_groups(res, "rl", split, "perm")))
    lines.append(change_row("RL vs continued SFT (same warm start)", arm_groups(res, "rl", split, "csft")))
    return lines + [""]


def result_lines(res: dict[str, dict], partial: bool) -> list[str]:
    """The study's answer: each confirmatory comparison (:data:`PRIMARY`) as a two-sided bootstrap test
    (:func:`nested_paired_test`), Holm-adjusted across those that have runs, with the change this design detects at
    power :data:`POWER` at Holm's strictest level (a normal approximation from the bootstrap standard error), and a
    verdict that can come out either way."""
    rows = []
    # a comparison with no runs yet is not in the family
    tests = {(split, label): nested_paired_test(groups) for split, label, base in PRIMARY
             for groups in [arm_groups(res, "rl", split, base)] if any(groups)}
    m = len(tests)
    for key, p_adj in zip(tests, holm([t["p"] for t in tests.values()])):
        tests[key]["p_holm"] = p_adj
    z = NormalDist().inv_cdf(1 - ALPHA / (2 * max(1, m))) + NormalDist().inv_cdf(POWER)
    for split, label, _ in PRIMARY:
        t = tests.get((split, label))
        if t is None:
            rows.append(f"| {split} | {label} | not run yet | | | | |")
            continue
        if t["p_holm"] <= ALPHA:
            verdict = "**RL higher**" if t["change"] > 0 else "**RL lower**"
        else:
            verdict = "no difference detected"
        rows.append(f"| {split} | {label} | {t['change']:+.3f} [{t['low']:+.3f}, {t['high']:+.3f}] | {t['p']:.3g} | "
                    f"{t['p_holm']:.3g} | {z * t['se']:.3f} | {verdict} |")
    title = "Result so far (preliminary: the study is partial)" if partial else "Result"
    return [f"**{title}**: the preset's task types on the held-out splits, each comparison a two-sided bootstrap "
            f"test (the interval's resampling of warm starts, runs and games), Holm-adjusted across the {m} "
            f"comparisons with runs at alpha {ALPHA}; the minimal detectable effect (MDE) is the change found with "
            f"power {POWER} at Holm's strictest level, alpha / {max(1, m)}.", "",
            "| split | comparison | change [95% CI] | bootstrap p | Holm p | MDE | verdict |",
            "| --- | --- | --- | --- | --- | --- | --- |", *rows, ""]


def type_counts(units: list[dict], split: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for u in units:
        for ev in ((u.get("evals") or {}).get(s) for s in (split, f"{split}_other")):
            for t, n in ((ev or {}).get("episodes_by_type") or {}).items():
                acc = out.setdefault(t, [0, 0])
                acc[0] += round(ev.get(f"success_{t}", 0.0) * n)
                acc[1] += n
    return out


def type_table(res: dict[str, dict], split: str) -> list[str]:
    cols = [("warm", "warm starts")] + list(ARMS)
    by_col = {kind: type_counts([u for u in res.values() if u["kind"] == kind], split) for kind, _ in cols}
    lines = [f"**{split}, per task type** (successes / episodes, pooled over the column's models)", "",
             "| task type | " + " | ".join(label for _, label in cols) + " |", "|" + " --- |" * (len(cols) + 1)]
    for t in TASK_TYPES.values():
        cells = []
        for kind, _ in cols:
            s, n = by_col[kind].get(t, [0, 0])
            cells.append(f"{s / n:.3f} ({s}/{n})" if n else "no games")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines + [""]


def mean_wall(res: dict[str, dict], kind: str) -> float | None:
    """The mean wall time of the saved units of ``kind`` (``None`` before the first); RL runs and permuted-reward runs
    do the same work, so each stands for the other."""
    kinds = ("rl", "perm") if kind in ("rl", "perm") else (kind,)
    walls = [r["wall_s"] for r in res.values() if r["kind"] in kinds]
    return sum(walls) / len(walls) if walls else None


def cost_lines(res: dict[str, dict], s: dict) -> list[str]:
    """Wall time per kind of unit, from the saved units, and what the units not yet saved would take at those
    times (an RL run stands for a permuted-reward one: the same work)."""
    k, n = s.get("warm_starts", 0), s.get("seeds", 0)
    planned = {"sft": k, "warm": k, "rl": k * n, "perm": k * n, "csft": k}
    planned |= {"rewarm": n_re} if (n_re := sum(r["kind"] == "rewarm" for r in res.values())) else {}
    walls = {kind: [r["wall_s"] for r in res.values() if r["kind"] == kind] for kind in planned}
    rows, left_s, unknown = [], 0.0, []
    for kind, total in planned.items():
        own = walls[kind]  # its own kind's mean; before the first, what stands for it (mean_wall)
        mean = sum(own) / len(own) if own else mean_wall(res, kind)
        if mean is None and total > len(walls[kind]):
            unknown.append(kind)
        left_s += (mean or 0.0) * (total - len(walls[kind]))
        rows.append(f"| {kind} | {len(walls[kind])} of {total} | "
                    + (f"{mean / 60:.1f} | " if mean is not None else "- | ") + f"{sum(walls[kind]) / 3600:.2f} |")
    spent = sum(sum(w) for w in walls.values()) / 3600
    left = (f"about {left_s / 3600:.1f} h more at these times" if left_s else "nothing more") + (
        f", plus the {', '.join(unknown)} units (none timed yet)" if unknown else "")
    return ["**Cost** (wall time per unit, as the machines that ran them saved it)", "",
            "| unit | saved | minutes per unit (mean) | hours spent |", "| --- | --- | --- | --- |", *rows, "",
            f"Spent {spent:.1f} h; the units left take {left}.", ""]


def write(root: Path, out: Path, *, command: str) -> str:
    res = load(root)
    settings_path = root / "settings.json"
    s = json.loads(settings_path.read_text()) if settings_path.exists() else {}
    planned = (s.get("warm_starts", 0) * (2 + 2 * s.get("seeds", 0) + 1)) if s else None
    done = sum(u["kind"] != "rewarm" for u in res.values())
    lines = ["# ALFWorld confirmatory study: RL from several warm starts against two controls", "",
             f"_Generated by `{command}` ({stamp()}) from the saved results under `{shown(root)}`. Do not edit by hand._"
             + (" **SMOKE RUN: numbers mean nothing.**" if s.get("smoke") else ""), ""]
    if planned is not None and done < planned:
        lines += [f"**Partial: {done} of {planned} units saved.** Rerun `run` to finish the study.", ""]
    lines += [f"- Preset `alfworld_demo` frozen; {s.get('warm_starts', '?')} SFT warm starts (its SFT, `loop.seed` = "
              f"1..K) x {s.get('seeds', '?')} RL seeds, {s.get('updates', '?')} updates each; "
              f"{s.get('dev_games', '?')} train games held out of RL as the `dev` split (the only split to tune on; "
              "held out of RL only: the warm start's scripted demos cover every train game of the two types).",
              "- Controls: the same RL with each batch's rewards permuted among its trajectories "
              "(`algo.permute_rewards`), and continued SFT on the scripted demos for as many optimizer steps x "
              "sequences as RL's updates x batch, at RL's optimizer settings.",
              f"- Evaluation: valid_seen and valid_unseen ({s.get('data', '?')}) on the preset's task types "
              f"({', '.join(s.get('preset_types') or ['?'])}: the confirmatory games) at "
              f"{s.get('warm_samples', '?')} plays per game for a warm start and {s.get('samples', '?')} for a "
              f"trained model, and on the other task types at {s.get('other_samples', '?')} per game for every model "
              f"(the six-type rows join both); dev {s.get('dev_samples', '?')} plays per game. Each arm is paired "
              "game by game with its own warm start; intervals resample warm starts, then runs, then games.", ""]
    lines += result_lines(res, planned is not None and done < planned)
    lines += remade_lines(res)
    lines += cost_lines(res, s)
    for split in SPLITS:
        lines += change_table(res, split, f"{split}, the preset's task types")
        if split != "dev":
            lines += change_table(res, f"{split}+other", f"{split}, all six task types")
        lines += type_table(res, split)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n".join(lines)
    out.write_text(text)
    return text
