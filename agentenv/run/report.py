"""The before/after report of a training run: what ``agentenv demo`` prints (and any run that evaluates at its start
and end): curves over updates as sparklines, the evaluation before and after RL side by side -- per eval split, with
a 95% confidence interval over the eval episodes, the change with its own interval, and success per task type when
the env has task types -- the wall time, and ``RUN/demo_result.json``. It drives :func:`agentenv.run.train.run`; the
only numbers it computes itself are the intervals (:func:`wilson_interval`, :func:`difference_interval`,
:func:`paired_difference_interval`; and, for several runs from one warm start, :func:`pool_task_successes`
and :func:`runs_and_tasks_interval`; for runs from several warm starts, :func:`nested_paired_interval`, and the
same bootstrap as a test, :func:`nested_paired_test`).

Each success rate's interval (Wilson) treats eval episodes as independent draws. With ``eval.samples > 1`` several
episodes share a task, so read it as "over episodes of these tasks". The change is measured on the same tasks before
and after, so its interval pairs them: the task is the unit (its episodes are not independent of each other, and a
hard game stays hard after RL), the interval is a seeded bootstrap over tasks of the mean per-task change
(:func:`paired_difference_interval`). Where the evaluations carry no per-task counts (an older ``eval.jsonl``, or
fewer than two tasks) the change falls back to Newcombe's interval for two independent proportions; the table
says which one it printed.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np

from agentenv.run.plot import ascii_curve
from agentenv.run.train import run

Z95 = 1.959964  # two-sided 95% normal quantile


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (well behaved at 0 and 1 successes, unlike the normal one)."""
    if n <= 0:
        raise ValueError("a confidence interval needs at least one episode")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, {n}], got {successes}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    # At 0 or n successes the bound is exactly 0 or 1; rounding would otherwise leave it a hair inside
    return (0.0 if successes == 0 else max(0.0, centre - half)), (1.0 if successes == n else min(1.0, centre + half))


def difference_interval(s1: int, n1: int, s2: int, n2: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's hybrid score interval for p2 - p1 (two independent proportions, built from their Wilson intervals)."""
    p1, p2 = s1 / n1, s2 / n2
    l1, u1 = wilson_interval(s1, n1, z)
    l2, u2 = wilson_interval(s2, n2, z)
    d = p2 - p1
    return d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)


def paired_difference_interval(before: dict, after: dict, *, level: float = 0.95, resamples: int = 10_000,
                               seed: int = 0) -> tuple[float, float, int]:
    """Interval for the mean per-task change in success, pairing each task with itself.

    ``before`` / ``after`` map a task key to ``[successes, episodes]`` (:func:`agentenv.run.evaluation.evaluate`'s
    ``task_successes``). Over the tasks both played, d_j = after rate - before rate; the interval is the percentile
    bootstrap of mean(d) with tasks resampled (the tasks are the independent draws, not their episodes). Seeded, so
    a report is reproducible. Returns (low, high, number of paired tasks)."""
    keys = sorted(set(before) & set(after), key=str)
    if len(keys) < 2:
        raise ValueError(f"a paired interval needs at least two tasks played before and after, got {len(keys)}")
    for k in keys:
        for counts in (before[k], after[k]):
            s, n = counts
            if not (n >= 1 and 0 <= s <= n):
                raise ValueError(f"task {k}: counts must be [successes, episodes] with 0 <= successes <= episodes >= 1, "
                                 f"got {counts}")
    d = np.array([after[k][0] / after[k][1] - before[k][0] / before[k][1] for k in keys])
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi), len(keys)


def pool_task_successes(evaluations: list[dict]) -> dict[str, list[int]]:
    """Per task, ``[successes, episodes]`` summed over several evaluations of one split (their ``task_successes``):
    the counts of one procedure played more times -- a warm start evaluated twice, or N RL runs from it."""
    if not evaluations:
        raise ValueError("nothing to pool: no evaluations given")
    pooled: dict[str, list[int]] = {}
    for ev in evaluations:
        if not ev.get("task_successes"):
            raise ValueError(f"evaluation of {ev.get('split', '?')} at update {ev.get('update', '?')} has no per-task "
                             "counts (task_successes); it cannot be pooled by task")
        for k, (s, n) in ev["task_successes"].items():
            acc = pooled.setdefault(str(k), [0, 0])
            acc[0] += int(s)
            acc[1] += int(n)
    return pooled


def runs_and_tasks_interval(before: dict, afters: list[dict], *, level: float = 0.95, resamples: int = 10_000,
                            seed: int = 0) -> tuple[float, float, int]:
    """Interval for the pooled per-task change of several RL runs against one (pooled) warm start, resampling RUNS and
    then tasks.

    :func:`paired_difference_interval` on pooled counts treats every run as more plays of one policy, which hides how
    far runs differ from each other (one lucky run then looks like evidence). Here each bootstrap replicate draws the
    runs with replacement, pools their counts per task, draws the tasks with replacement and takes the mean over them
    of (pooled after rate - before rate): both the run-to-run spread and the task-to-task spread widen it. With one run
    it is :func:`paired_difference_interval`. Returns (low, high, number of paired tasks)."""
    if not afters:
        raise ValueError("a pooled interval needs at least one RL run's evaluation")
    keys = sorted(set(before).intersection(*afters), key=str)
    if len(keys) < 2:
        raise ValueError(f"a paired interval needs at least two tasks played before and by every run, got {len(keys)}")
    b = np.array([before[k][0] / before[k][1] for k in keys])
    s = np.array([[a[k][0] for k in keys] for a in afters], dtype=float)  # runs x tasks
    n = np.array([[a[k][1] for k in keys] for a in afters], dtype=float)
    if (n < 1).any() or (s < 0).any() or (s > n).any() or any(before[k][1] < 1 for k in keys):
        raise ValueError("counts must be [successes, episodes] with 0 <= successes <= episodes >= 1")
    rng = np.random.default_rng(seed)
    runs = rng.integers(0, len(afters), size=(resamples, len(afters)))
    tasks = rng.integers(0, len(keys), size=(resamples, len(keys)))
    rate = s[runs].sum(axis=1) / n[runs].sum(axis=1)  # replicate x task: the drawn runs pooled
    d = np.take_along_axis(rate, tasks, axis=1) - b[tasks]
    alpha = (1 - level) / 2
    lo, hi = np.quantile(d.mean(axis=1), [alpha, 1 - alpha])
    return float(lo), float(hi), len(keys)


def nested_paired_interval(groups: list[list[tuple[dict, dict]]], *, level: float = 0.95, resamples: int = 10_000,
                           seed: int = 0) -> tuple[float, float, float, int]:
    """The mean per-task change over runs that come in groups (RL seeds from one warm start, grouped by warm start),
    each run paired with its OWN before: ``groups[g]`` = ``[(before, after), ...]`` of ``task_successes`` counts.

    Change = mean over groups of the mean over their runs of the mean over tasks of (after rate - before rate). The
    interval resamples groups, then runs within each drawn group, then tasks (percentile bootstrap, seeded), so the
    spread between warm starts, between seeds and between games all widen it. Returns (change, low, high, tasks)."""
    t = nested_paired_test(groups, level=level, resamples=resamples, seed=seed)
    return t["change"], t["low"], t["high"], t["tasks"]


def nested_paired_test(groups: list[list[tuple[dict, dict]]], *, level: float = 0.95, resamples: int = 10_000,
                       seed: int = 0) -> dict:
    """:func:`nested_paired_interval` as a test: ``{change, low, high, tasks, se, p, before, after}``; ``before`` and
    ``after`` are weighted as the change is, so after - before = change. A side of a pair may also be a list of
    ``(sign, counts)`` whose per-task rates add up: a difference in differences, e.g. a control's change carried onto
    another starting point, ``[(1, control), (-1, control_start), (1, own_start)]``. ``se`` is the bootstrap
    replicates' standard deviation; ``p`` the two-sided bootstrap p of "no change" that matches the percentile
    interval (twice the smaller tail of replicates at or beyond 0, as ``(k + 1) / (R + 1)``, so never 0): the
    interval excludes 0 at level 1 - a exactly when p <= a, up to the replicates' granularity."""
    groups = [g for g in groups if g]
    pairs = [p for g in groups for p in g]
    if not pairs:
        raise ValueError("a nested interval needs at least one (before, after) pair")

    def terms(side) -> list[tuple[int, dict]]:  # a side is counts, or [(sign, counts), ...] whose rates add up
        return side if isinstance(side, list) else [(1, side)]

    keys = sorted(set.intersection(*(set(c) for b, a in pairs for _, c in terms(b) + terms(a))), key=str)
    if len(keys) < 2:
        raise ValueError(f"a paired interval needs at least two tasks played in every evaluation, got {len(keys)}")

    def one(counts: dict) -> np.ndarray:
        c = np.array([counts[k] for k in keys], dtype=float)
        if (c[:, 1] < 1).any() or (c[:, 0] < 0).any() or (c[:, 0] > c[:, 1]).any():
            raise ValueError("counts must be [successes, episodes] with 0 <= successes <= episodes >= 1")
        return c[:, 0] / c[:, 1]

    def rates(side) -> np.ndarray:
        return sum(sign * one(c) for sign, c in terms(side))

    def nested_mean(side: int) -> float:  # over groups, then their runs, then tasks: the change's own weighting
        return float(np.mean([np.mean([rates(p[side]) for p in g], axis=0) for g in groups], axis=0).mean())

    diffs = [np.array([rates(a) - rates(b) for b, a in g]) for g in groups]  # per group: runs x tasks
    change = float(np.mean([d.mean(axis=0) for d in diffs], axis=0).mean())
    rng = np.random.default_rng(seed)
    per_group = np.stack([d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1) for d in diffs])
    drawn = rng.integers(0, len(groups), size=(resamples, len(groups)))
    by_task = per_group[drawn, np.arange(resamples)[:, None]].mean(axis=1)  # replicate x task
    tasks = rng.integers(0, len(keys), size=(resamples, len(keys)))
    boot = np.take_along_axis(by_task, tasks, axis=1).mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(boot, [alpha, 1 - alpha])
    tail = min(int((boot <= 0).sum()), int((boot >= 0).sum()))
    p = min(1.0, 2 * (tail + 1) / (resamples + 1))
    return {"change": change, "low": float(lo), "high": float(hi), "tasks": len(keys), "se": float(boot.std()),
            "p": p, "before": nested_mean(0), "after": nested_mean(1)}


def _successes(ev: dict) -> int:
    return int(ev.get("successes", round(ev["success_rate"] * ev["episodes"])))


def before_after_table(before: list[dict], after: list[dict], updates: int) -> list[str]:
    """Lines of the before/after table: one block per eval split (matched by name)."""
    lines = [f"{'':24s}{'warm start (SFT)':>24s}{f'after {updates} RL updates':>26s}{'change':>26s}"]
    kinds: set[str] = set()
    for b in before:
        a = next((e for e in after if e["split"] == b["split"]), None)
        if a is None:
            continue
        sb, sa, nb, na = _successes(b), _successes(a), b["episodes"], a["episodes"]
        lb, ub = wilson_interval(sb, nb)
        la, ua = wilson_interval(sa, na)
        paired = None
        if len(set(b.get("task_successes") or {}) & set(a.get("task_successes") or {})) >= 2:
            ld, ud, paired = paired_difference_interval(b["task_successes"], a["task_successes"])
        else:
            ld, ud = difference_interval(sb, nb, sa, na)
        kinds.add("paired" if paired else "newcombe")
        lines.append(f"  {b['split']} ({nb} episodes" + (f" of {paired} tasks)" if paired else ")"))
        lines.append(f"    {'success':20s}{b['success_rate']:8.2f} [{lb:.2f}, {ub:.2f}]    {a['success_rate']:10.2f} "
                     f"[{la:.2f}, {ua:.2f}]    {a['success_rate'] - b['success_rate']:+10.2f} [{ld:+.2f}, {ud:+.2f}]")
        if b.get("tool_call_rate") or a.get("tool_call_rate"):
            lines.append(f"    {'tool-call rate':20s}{b['tool_call_rate']:8.2f}{'':15s}{a['tool_call_rate']:10.2f}")
        types = sorted(k[len("success_"):] for k in b if k.startswith("success_") and k != "success_rate")
        for t in types:
            key, nbt, nat = f"success_{t}", b.get("episodes_by_type", {}).get(t), a.get("episodes_by_type", {}).get(t)
            if key in a:
                lines.append(f"      {t:26s}{b[key]:6.2f}{'':15s}{a[key]:10.2f}"
                             + (f"{'':17s}({nbt} / {nat} episodes)" if nbt else ""))
        if "turns_mean" in b:
            lines.append(f"    {'turns / episode':20s}{b['turns_mean']:8.2f}{'':15s}{a['turns_mean']:10.2f}")
    how = {"paired": "bootstrap over tasks, each paired with itself", "newcombe": "Newcombe interval"}
    weights = next((e["weights"] for e in after if e.get("weights")), None)
    if weights:
        lines.append(f"  (after: the {weights})")
    lines.append("  (success: mean and 95% Wilson interval over eval episodes; change: 95% "
                 + ", or ".join(how[k] for k in sorted(kinds, reverse=True)) + ")")
    return lines


def run_demo(cfg, *, progress: bool = True, echo=print) -> int:
    """``agentenv demo``: SFT warm start + FlashREINFORCE; prints before/after and curves."""
    t0 = time.perf_counter()
    s = cfg.sft
    what = {"scripted": f"{s.num_demos} scripted demos ({s.tool_fraction:.0%} use the tool)",
            "expert": f"{s.num_demos} expert demos (noise {s.expert_noise:g})"}.get(s.demos, f"demos from {s.demos}")
    warm = f"SFT warm start on {what}" if s.enabled else "no SFT warm start (sft.enabled=false)"
    echo(f"agentenv demo: env {cfg.env.id}, model {cfg.model.name}, {cfg.loop.total_updates} updates x "
         f"{cfg.loop.batch_size} trajectories, {warm}")
    e = cfg.eval
    when = " and ".join(w for w, on in (("before", e.at_start), ("after", e.at_end)) if on)
    if when:
        plays = ", ".join(f"{split or 'training tasks'} {e.samples_for(split)}" for split in (e.splits or [None]))
        on = f", {e.samplers} samplers at once" if e.samplers > 1 else ""
        echo(f"evaluation {when} RL, plays per task: {plays}{on}")
    res = run(cfg, progress=progress, echo=echo)
    wall = time.perf_counter() - t0
    first = min((e["update"] for e in res.evals), default=None)
    last = max((e["update"] for e in res.evals), default=None)
    before = [e for e in res.evals if e["update"] == first == 0]
    # per split the LAST evaluation at the last update: with a weight average that is the mean's, not the one that
    # eval.every took of the last update's weights
    after = list({e["split"]: e for e in res.evals if e["update"] == last and last and last > 0}.values())
    h = res.history
    echo("")
    echo("curves over updates (batch values, 0..1):")
    for key, label in (("success_rate", "success"), ("tool_call_rate", "tool-call rate"), ("acceptance_rate", "accepted")):
        vals = [float(m.get(key, 0.0)) for m in h]
        if vals and (key != "tool_call_rate" or any(vals)):
            echo(f"  {label:14s} {ascii_curve(vals)}  {vals[0]:.2f} -> {sum(vals[-5:]) / len(vals[-5:]):.2f} (last 5)")
    table: list[str] = []
    if before and after:
        table = before_after_table(before, after, int(res.summary.get("updates", len(h))))
        echo("")
        for line in table:
            echo(line)
    echo(f"wall time {wall:.0f}s; run dir {res.run_dir}; plot {res.run_dir / 'curves.png'}")
    by_split = (lambda evs: {e["split"]: e for e in evs})  # named by split, so a reader knows what was measured
    (res.run_dir / "demo_result.json").write_text(json.dumps(
        {"before": by_split(before), "after": by_split(after), "table": table, "wall_s": wall, "updates": len(h)},
        indent=2))
    return 0
