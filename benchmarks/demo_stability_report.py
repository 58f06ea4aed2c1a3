"""The demo stability study's report, from saved results only (``benchmarks/demo_stability.py`` writes the units).

Contract: per arm, its runs' failures (held-out success or tool-call rate below the demo's target) as k/n with a
Wilson interval, held-out success as mean [t interval] and its worst run, how many runs' call format broke, the median
peak malformed blocks and the fewest rows the gate admitted. Each arm against ``preset``: a two-sided permutation
test of the failure indicator (the primary question, Holm-adjusted across arms) and of held-out success (Welch
alongside), with a verdict that can come out either way; and, per arm, the most failures it could have and still
pass its test at these run counts (the design's power, in runs). A partial study says so at the top.
"""

from __future__ import annotations

import statistics

from agentenv.core.stats import holm, mean_ci, permutation_p, welch
from agentenv.run.report import wilson_interval

ALPHA = 0.05


def by_arm(res: dict[str, dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in res.values():
        if r["kind"] == "rl":
            out.setdefault(r["arm"], []).append(r)
    return out


def most_failures_that_pass(base: list[float], m: int, level: float) -> int | None:
    """The most failures of ``m`` runs whose permutation test against ``base`` (failure indicators) reaches
    ``level`` with fewer failures than ``base``; ``None`` when even none would not."""
    best = None
    for f in range(m + 1):
        arm = [1.0] * f + [0.0] * (m - f)
        if f / m < sum(base) / len(base) and permutation_p(base, arm) <= level:
            best = f
    return best


def arm_row(arm: str, runs: list[dict]) -> str:
    fails = sum(r["failed"] for r in runs)
    lo, hi = wilson_interval(fails, len(runs))
    succ = [r["heldout"]["success_rate"] for r in runs]
    mean, slo, shi = mean_ci(succ)
    ci = f" [{slo:.2f}, {shi:.2f}]" if len(succ) > 1 else ""
    admitted = [r["train"]["fewest_admitted"] for r in runs if r["train"]["fewest_admitted"] is not None]
    batch = runs[0]["train"].get("batch_size")
    return (f"| {arm} | {' '.join(runs[0]['overrides']) or '(the preset)'} | {len(runs)} | {fails} of {len(runs)} "
            f"[{lo:.2f}, {hi:.2f}] | {mean:.3f}{ci} | {min(succ):.2f} | "
            f"{sum(r['train']['format_broke'] for r in runs)} | "
            f"{statistics.median(r['train']['peak_malformed'] for r in runs):.2f} | "
            f"{min(admitted) if admitted else '-'}{f' of {batch}' if batch and admitted else ''} | "
            f"{statistics.mean(r['wall_s'] for r in runs) / 60:.1f} |")


def comparison_rows(arms: dict[str, list[dict]], order: list[str]) -> list[str]:
    base = arms.get("preset", [])
    fx = [float(r["failed"]) for r in base]
    sx = [r["heldout"]["success_rate"] for r in base]
    others = [a for a in order if a in arms and a != "preset"]
    p_fail = {a: permutation_p(fx, [float(r["failed"]) for r in arms[a]]) for a in others}
    p_holm = dict(zip(others, holm([p_fail[a] for a in others]))) if others else {}
    rows = []
    for a in others:
        fy = [float(r["failed"]) for r in arms[a]]
        sy = [r["heldout"]["success_rate"] for r in arms[a]]
        diff = sum(sy) / len(sy) - sum(sx) / len(sx)
        p_w = f"{welch(sx, sy)[3]:.3g}" if len(sx) > 1 and len(sy) > 1 else "-"  # Welch needs two runs a side
        if p_holm[a] <= ALPHA:
            verdict = "**fails less**" if sum(fy) / len(fy) < sum(fx) / len(fx) else "**fails more**"
        else:
            verdict = "no difference detected"
        need = most_failures_that_pass(fx, len(fy), ALPHA / len(others))
        rows.append(f"| {a} vs preset | {int(sum(fx))} of {len(fx)} vs {int(sum(fy))} of {len(fy)} | "
                    f"{p_fail[a]:.3g} | {p_holm[a]:.3g} | {diff:+.3f} | {p_w} | {permutation_p(sx, sy):.3g} | "
                    f"{'none would' if need is None else f'{need} of {len(fy)}'} | {verdict} |")
    return rows


def report_lines(res: dict[str, dict], s: dict) -> list[str]:
    arms = by_arm(res)
    order = [a for a in s.get("arms") or [] if a in arms] + sorted(a for a in arms if a not in (s.get("arms") or []))
    planned = s.get("warm_starts", 0) * (1 + s.get("seeds", 0) * len(s.get("arms", [])))
    runs = [r for rs in arms.values() for r in rs]
    ev = runs[0]["heldout"]["episodes"] if runs else "?"
    updates = runs[0]["train"]["updates"] if runs else "?"
    lines = [f"**Partial: {len(res)} of {planned} units saved.** Rerun the study to finish it.", ""] \
        if len(res) < planned else []
    lines += [f"- {s.get('warm_starts')} SFT warm starts (the demo's SFT, `loop.seed` = 0..K-1) x {s.get('seeds')} "
              f"RL seeds per arm, every arm's RL at lr {s.get('lr'):g} (the preset's is 1e-4: a stress that makes "
              f"the rare failure common enough to count), {updates} updates; the final weights evaluated on {ev} "
              "held-out questions.",
              "- A run **failed** when held-out success < 0.6 or tool-call rate < 0.7 (the demo's per-seed target). "
              "Format broke: the run log's `TOOL-CALL FORMAT BREAKING` alarm fired.", "",
              "| arm | overrides | runs | failed [95% Wilson] | held-out success [95% CI] | worst run | format broke "
              "| median peak malformed | fewest admitted | minutes per run |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
              *(arm_row(a, arms[a]) for a in order), ""]
    if "preset" in arms and len(arms) > 1:
        lines += [f"Each arm against `preset`: two-sided permutation tests (runs unpaired), the failure indicator "
                  f"Holm-adjusted across the {len(arms) - 1} arms at alpha {ALPHA}; 'passes with at most' is the "
                  "most failures an arm's runs could have and still pass that test here.", "",
                  "| comparison | failures | permutation p (failed) | Holm p | success difference | Welch p | "
                  "permutation p (success) | passes with at most | verdict |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *comparison_rows(arms, order), ""]
    return lines
