"""The ablations' report, from saved results only: ``ROOT/results/*.json`` (one per finished variant x seed) and
``ROOT/warm_start.json`` -> a markdown table and verdicts (``docs/results.md``), stamped with commit, UTC date and
machine (``scripts/figures.py``'s :func:`stamp`).

Contract:

* Per variant: mean and 95% t interval over seeds of the held-out success, tool-call rate, answer length (policy
  tokens per episode), success on hard and easy questions, and the training's measured lag, gate acceptance and
  sequence KL.
* Per comparison in :data:`COMPARISONS` (variant vs baseline on one outcome, with the paper's direction): Welch's
  two-sided test (a permutation p alongside), Holm-adjusted across every comparison that has at least two runs per
  side; the minimal detectable effect at power 0.8 from the pooled seed sd at the Bonferroni level alpha / m (what
  Holm's first step uses), and the runs per side the paper's effect size would need at that sd.
* A figure (:func:`plot`, next to the markdown as ``.png``): per comparison, every run's value of its outcome for
  baseline and variant, the means with their 95% intervals, and the test's difference, Holm p and verdict.
* Verdict (:func:`verdict`): "reproduces" -- adjusted p <= alpha in the paper's direction; "refuted" -- adjusted
  p <= alpha the other way, or no significant difference although the MDE is below the paper's effect size (a
  difference that large would very likely have been found); "unresolved at this budget" otherwise. A comparison
  without a stated direction (exploratory) reads "differs" or "no difference detected".
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from agentenv.core.config import load_config
from agentenv.core.stats import holm, mean_ci, minimal_detectable_effect, permutation_p, runs_needed, welch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from figures import shown, stamp  # noqa: E402  (scripts/figures.py: the stamp and paths every figure uses)
PAPER_GAP = 0.067  # the paper's tool-task gap between FlashREINFORCE and its ablations (6.7 points of success)


@dataclass(frozen=True)
class Comparison:
    variant: str
    baseline: str
    metric: str  # a key of :func:`outcome_values`
    direction: int  # the paper's sign of (variant - baseline); 0 = no stated direction
    paper_effect: float | None  # the size the paper reports, in the metric's units (None: not stated)
    claim: str


COMPARISONS: dict[str, Comparison] = {
    "length": Comparison("token_mean", "flashreinforce", "length_drift", +1, None,
                         "the token mean lets the answer length drift from the warm start's; the sample mean keeps it"),
    "grpo_tool_calls": Comparison("grpo", "flashreinforce", "tool_call_rate", -1, PAPER_GAP,
                                  "GRPO's tool-call rate falls where FlashREINFORCE's holds"),
    "trust_gate_under_lag": Comparison("no_trust_lag", "flashreinforce_lag", "success_rate", -1, PAPER_GAP,
                                       "under lag, turning the sequence trust gate off lowers success"),
    "is_under_lag": Comparison("no_is_lag", "flashreinforce_lag", "success_rate", -1, PAPER_GAP,
                               "under lag, dropping token importance sampling lowers success"),
    "failure_filter_q0.9": Comparison("q0.9", "flashreinforce", "success_rate", +1, None,
                                      "the failure filter at the paper's q = 0.9 raises success"),
    "failure_filter_q0.2": Comparison("q0.2", "flashreinforce", "success_rate", 0, None,
                                      "a harsher filter, q = 0.2 (exploratory: no stated direction)"),
}
COLUMNS = (("success_rate", "held-out success", 3), ("tool_call_rate", "tool-call rate", 3),
           ("policy_tokens_mean", "length (tokens)", 1), ("success_multiply", "hard", 3),
           ("success_multiply_easy", "easy", 3), ("lag_mean", "lag", 1), ("acceptance_rate", "acceptance", 2),
           ("seq_kl_mean", "seq KL", 5))


def load(root: Path) -> tuple[dict[str, list[dict]], dict]:
    by_variant: dict[str, list[dict]] = {}
    for f in sorted((root / "results").glob("*.json")):
        r = json.loads(f.read_text())
        by_variant.setdefault(r["variant"], []).append(r)
    ws = root / "warm_start.json"
    return by_variant, (json.loads(ws.read_text()) if ws.exists() else {})


def outcome_values(r: dict, warm: dict) -> dict[str, float]:
    """One run's numbers, flat: held-out outcomes, training measurements, and the length drift from the warm start."""
    vals = {k: v for k, v in {**r["heldout"], **r["train"]}.items() if isinstance(v, (int, float))}
    vals.setdefault("tool_call_rate", vals.get("tool_share"))  # results written before the rename
    if "policy_tokens_mean" in vals and warm.get("policy_tokens_mean") is not None:
        vals["length_drift"] = abs(vals["policy_tokens_mean"] - warm["policy_tokens_mean"])
    return vals


def column(runs: list[dict], warm: dict, key: str) -> list[float]:
    return [v for r in runs for v in [outcome_values(r, warm).get(key)] if v is not None and not math.isnan(v)]


def fmt_ci(xs: list[float], digits: int) -> str:
    if not xs:
        return "n/a"
    m, lo, hi = mean_ci(xs)
    return f"{m:.{digits}f}" if len(xs) < 2 else f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def run_tests(results: dict[str, list[dict]], warm: dict, alpha: float) -> dict[str, dict]:
    """Welch per comparison that has two runs a side, Holm across them, MDE and runs needed at the pooled sd."""
    tested: dict[str, dict] = {}
    for name, c in COMPARISONS.items():
        x, y = column(results.get(c.baseline, []), warm, c.metric), column(results.get(c.variant, []), warm, c.metric)
        if len(x) >= 2 and len(y) >= 2:
            d, _, _, p = welch(x, y)
            sd = math.sqrt((statistics.variance(x) + statistics.variance(y)) / 2)
            tested[name] = {"diff": d, "p": p, "p_perm": permutation_p(x, y), "sd": sd, "n": min(len(x), len(y))}
    m = max(1, len(tested))
    for name, p_adj in zip(tested, holm([t["p"] for t in tested.values()])):
        t, c = tested[name], COMPARISONS[name]
        t["p_holm"] = p_adj
        t["mde"] = minimal_detectable_effect(t["sd"], t["n"], alpha=alpha / m)
        t["runs_needed"] = runs_needed(c.paper_effect, t["sd"], alpha=alpha / m) if c.paper_effect and t["sd"] else None
        t["verdict"] = verdict(c, t, alpha)
    return tested


def verdict(c: Comparison, t: dict, alpha: float) -> str:
    significant, sign = t["p_holm"] <= alpha, (t["diff"] > 0) - (t["diff"] < 0)
    if c.direction == 0:
        return "differs" if significant else "no difference detected"
    if significant:
        return "reproduces" if sign == c.direction else "refuted (significant in the opposite direction)"
    if c.paper_effect is not None and t["mde"] < c.paper_effect:
        return f"refuted (no effect of the paper's size {c.paper_effect:.3f}; detectable here: {t['mde']:.3f})"
    return "unresolved at this budget"


def variant_table(results: dict[str, list[dict]], warm: dict, order: list[str]) -> list[str]:
    head = "| variant | runs | " + " | ".join(label for _, label, _ in COLUMNS) + " | wall s / run |"
    lines = [head, "|" + " --- |" * (len(COLUMNS) + 3)]
    if warm:
        lines.append(f"| warm start (SFT) | 1 | {warm.get('success_rate', math.nan):.3f} | "
                     f"{warm.get('tool_call_rate', warm.get('tool_share', math.nan)):.3f} | {warm.get('policy_tokens_mean', math.nan):.1f} |"
                     + " |" * (len(COLUMNS) - 2))
    for v in order:
        runs = results.get(v, [])
        if runs:
            cells = [fmt_ci(column(runs, warm, k), d) for k, _, d in COLUMNS]
            wall = statistics.fmean(r["wall_s"] for r in runs)
            lines.append(f"| {v} | {len(runs)} | " + " | ".join(cells) + f" | {wall:.0f} |")
    return lines


def comparison_lines(tested: dict[str, dict], alpha: float) -> list[str]:
    lines = ["| comparison | paper's direction | difference (variant - baseline) | Welch p | permutation p | Holm p "
             "| seed sd | MDE (power 0.8) | runs needed for the paper's effect | verdict |",
             "|" + " --- |" * 10]
    for name, c in COMPARISONS.items():
        t = tested.get(name)
        if t is None:
            lines.append(f"| {name} | {c.claim} | not tested: fewer than 2 runs of {c.variant} or {c.baseline} "
                         "| | | | | | | unresolved at this budget |")
            continue
        lines.append(f"| {name} ({c.variant} vs {c.baseline}, {c.metric}) | {c.claim} | {t['diff']:+.3f} | "
                     f"{t['p']:.3g} | {t['p_perm']:.3g} | {t['p_holm']:.3g} | {t['sd']:.3f} | {t['mde']:.3f} | "
                     f"{t['runs_needed'] or 'n/a'} | **{t['verdict']}** |")
    return lines


def summary_lines(tested: dict[str, dict]) -> list[str]:
    groups: dict[str, list[str]] = {"reproduce": [], "refuted": [], "unresolved": [], "exploratory": []}
    for name, c in COMPARISONS.items():
        v = tested.get(name, {}).get("verdict", "unresolved at this budget")
        key = ("exploratory" if c.direction == 0 else "reproduce" if v == "reproduces" else
               "refuted" if v.startswith("refuted") else "unresolved")
        groups[key].append(name)
    return [f"- **{k}**: {', '.join(v) or 'none'}" for k, v in groups.items()]


def plot(results: dict[str, list[dict]], warm: dict, tested: dict[str, dict], png: Path, caption: str) -> None:
    """One panel per comparison: each run's outcome (a dot per seed) for baseline and variant, mean +- 95% CI."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    for ax, (name, c) in zip(axes.flat, COMPARISONS.items()):
        for x, v in enumerate((c.baseline, c.variant)):
            ys = column(results.get(v, []), warm, c.metric)
            ax.scatter([x + 0.12 * ((i % 5) - 2) / 2 for i in range(len(ys))], ys, s=14, alpha=0.6,
                       color=("tab:blue", "tab:orange")[x])
            if len(ys) >= 2:
                m, lo, hi = mean_ci(ys)
                ax.errorbar(x + 0.3, m, yerr=[[m - lo], [hi - m]], fmt="o", color="black", capsize=4)
        ax.set_xticks([0, 1], [c.baseline, c.variant], fontsize=8)
        ax.set_xlim(-0.5, 1.6)
        ax.set_ylabel(c.metric, fontsize=8)
        t = tested.get(name)
        note = (f"diff {t['diff']:+.3f}, Holm p {t['p_holm']:.2g}\n{t['verdict'][:48]}" if t else "not tested yet")
        ax.set_title(f"{name}\n{note}", fontsize=8)
    fig.suptitle(f"Ablations in miniature: dots are runs (seeds), bars the mean and 95% t interval\n{caption}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def write(root: Path, out: Path, *, settings: dict, command: str, smoke: bool) -> str:
    results, warm = load(root)
    alpha, stamp_text = settings["alpha"], stamp()
    tested = run_tests(results, warm, alpha)
    s = settings
    done, planned = sum(len(results.get(v, [])) for v in s["variants"]), len(s["variants"]) * len(s["seeds"])
    progress = ("" if done >= planned else f" **The study is in progress: {done} of its {planned} runs "
                f"({len(s['variants'])} variants x {len(s['seeds'])} seeds) are saved; `scripts/figures.py ablations` "
                "runs the rest and rewrites this file. Verdicts below are at the budget saved so far.**")
    lines = [
        "# Ablations in miniature: FlashREINFORCE variants on the CPU tool task", "",
        f"_Generated by `{command}` ({stamp_text}) from the saved results under `{shown(root)}`. Do not edit by hand._"
        + (" **SMOKE RUN: numbers mean nothing.**" if smoke else progress), "",
        f"- Task: the `demo` preset's multiplications, {s['easy']:.0%} of them easy (`A * 100`, which the no-tool "
        "guess answers right; `env.demo_easy_fraction`); one shared SFT warm start, then RL.",
        f"- Budget per run: {s['updates']} updates x {s['batch']} trajectories (GRPO: {s['batch'] // 4} prompts x 4).",
        f"- Lag variants: `loop.fixed_lag={s['lag']}` (synchronous rounds sampled exactly {s['lag']} versions behind "
        f"the learner once {s['lag']} versions exist; lag, acceptance and KL columns average the updates after the "
        f"first {s['lag']}).",
        f"- The gate compares the sequence KL with delta = {load_config('demo', [], []).algo.loss.delta:g} (the preset's): "
        "the lag runs' seq KL column is the drift the gate sees at that lag; well below delta the gate admits "
        "everything and cannot matter.",
        f"- Outcome: the final weights on {s['eval_episodes']} held-out questions (`heldout` split, never trained on); "
        "table: mean [95% t interval] over seeds.",
        "- Length drift (the `length` comparison): |mean policy tokens per episode - the warm start's|, over both "
        "answer paths. A tool-using answer (a call, then the answer) is several times as long as a guess, so a "
        "variant that calls the tool more drifts further for that reason alone: read it beside the tool-call rate "
        "column.",
        f"- Tests: Welch (two-sided), Holm-adjusted over the {len(tested)} tested comparisons at family-wise alpha "
        f"{alpha}; MDE at power 0.8 from the pooled seed sd at alpha / {max(1, len(tested))}. The paper's tool-task "
        f"gap is {PAPER_GAP} (6.7 points).", "",
        *variant_table(results, warm, settings["variants"]), "",
        "## The paper's directions, tested", "", *comparison_lines(tested, alpha), "", *summary_lines(tested), "",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot(results, warm, tested, png, stamp_text)
    lines.insert(lines.index("## The paper's directions, tested") + 2, f"![every run of each comparison]({png.name})\n")
    text = "\n".join(lines)
    out.write_text(text)
    return text
