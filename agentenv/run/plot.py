"""PNG training curves from one or more run directories (``agentenv plot RUN_DIR [RUN_DIR ...]``).

Contract: reads each run's ``metrics.jsonl`` (see :mod:`agentenv.core.metrics`), draws a 2x3 grid -- reward & success,
tool-call rate (share of trajectories with >= 1 call, and calls per trajectory), trust-gate acceptance rate, policy
lag (mean and max), length (policy tokens per trajectory) and turns (with invalid actions per trajectory, ALFWorld's
main failure, and the truncated share) -- with one colour per run (overlaid for comparison; light raw line + bold
moving average), and writes ``curves.png`` (default: into the first run dir).
Headless (Agg backend); missing metrics leave their panel with a note instead of failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from agentenv.core.metrics import read_metrics

PANELS = (
    ("Reward / success", [("reward_mean", "reward", "-"), ("success_rate", "success", "--")], (None, None)),
    ("Tool-call rate", [("tool_call_rate", "share with >=1 call", "-"), ("tool_calls_mean", "calls / traj", "--")], (0, None)),
    ("Trust-gate acceptance", [("acceptance_rate", "accepted", "-")], (-0.02, 1.02)),
    ("Policy lag (versions)", [("lag_mean", "mean", "-"), ("lag_max", "max", "--")], (0, None)),
    ("Length", [("policy_tokens_mean", "policy tokens / traj", "-")], (0, None)),
    ("Turns / invalid actions / truncation", [("turns_mean", "turns", "-"), ("invalid_actions_mean", "invalid actions", ":"),
                                              ("truncation_rate", "truncated", "--")], (0, None)),
)


def _smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], []
    for y in ys:
        acc.append(y)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None, *, title: str | None = None,
              smooth: int | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5), constrained_layout=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, series, ylim) in zip(axes.flat, PANELS):
        drawn = False
        for ri, (d, recs) in enumerate(runs):
            c = colors[ri % len(colors)]
            for key, label, style in series:
                pts = [(r["update"], float(r[key])) for r in recs if isinstance(r.get(key), (int, float))]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                k = smooth or max(1, len(ys) // 15)
                lab = f"{label}" if len(runs) == 1 else f"{d.name}: {label}"
                if k > 1:
                    ax.plot(xs, ys, style, color=c, alpha=0.25, linewidth=1)
                    ax.plot(xs, _smooth(list(ys), k), style, color=c, linewidth=2, label=lab)
                else:
                    ax.plot(xs, ys, style, color=c, linewidth=2, marker="o", markersize=3, label=lab)
                drawn = True
        ax.set_title(name, fontsize=12)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        if ylim != (None, None):
            ax.set_ylim(bottom=ylim[0], top=ylim[1])
        if drawn:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(title or " vs ".join(d.name for d, _ in runs), fontsize=13)
    out = Path(out) if out else runs[0][0] / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def ascii_curve(values: Sequence[float], width: int = 40, lo: float = 0.0, hi: float = 1.0) -> str:
    """A one-line sparkline for the terminal (the demo prints its curves with it)."""
    if not values:
        return ""
    blocks = " ▁▂▃▄▅▆▇█"
    n = len(values)
    step = max(1, -(-n // width))
    pts = [sum(values[i:i + step]) / len(values[i:i + step]) for i in range(0, n, step)]
    span = (hi - lo) or 1.0
    return "".join(blocks[min(8, max(0, round((v - lo) / span * 8)))] for v in pts)
