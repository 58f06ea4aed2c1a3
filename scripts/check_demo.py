"""CI's guard on the main job: did `agentenv demo` learn? Reads RUN/demo_result.json, exits 1 with the reason if not.

    agentenv demo --no-progress --run-dir runs/ci-demo && python scripts/check_demo.py runs/ci-demo

It judges the held-out evaluation (questions no SFT or RL step saw) after RL against floors set well below what the
demo reaches on every seed (docs/demo.md has the seeds and the margins) and well above what the regressed demo of
2026-12 reached (success 0.00-0.27 on training tasks): a quality check, not a timing. The thresholds are flags so
the margin is visible where CI calls it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def verdict(result: dict, *, split: str, min_success: float, min_tool_rate: float, min_gain: float) -> list[str]:
    """The reasons the run fails the check (empty: it passes)."""
    before, after = (result.get(k) or {} for k in ("before", "after"))
    if split not in after or split not in before:
        return [f"no {split!r} evaluation before and after RL in demo_result.json (it has "
                f"{sorted(after) or 'none'}); the demo must evaluate on held-out tasks"]
    b, a = before[split], after[split]
    reasons = []
    if a["success_rate"] < min_success:
        reasons.append(f"{split} success after RL {a['success_rate']:.2f} < {min_success:.2f}")
    rate = a.get("tool_call_rate", a.get("tool_share", 0.0))
    if rate < min_tool_rate:
        reasons.append(f"{split} tool-call rate after RL {rate:.2f} < {min_tool_rate:.2f}")
    if a["success_rate"] - b["success_rate"] < min_gain:
        reasons.append(f"{split} success gained {a['success_rate'] - b['success_rate']:+.2f} over the warm start "
                       f"({b['success_rate']:.2f} -> {a['success_rate']:.2f}) < {min_gain:+.2f}")
    return reasons


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--split", default="heldout")
    p.add_argument("--min-success", type=float, default=0.45)
    p.add_argument("--min-tool-rate", type=float, default=0.55)
    p.add_argument("--min-gain", type=float, default=0.25)
    args = p.parse_args(argv)
    path = args.run_dir / "demo_result.json"
    if not path.is_file():
        print(f"check_demo: FAIL: no {path} (did the demo finish?)")
        return 1
    result = json.loads(path.read_text())
    reasons = verdict(result, split=args.split, min_success=args.min_success, min_tool_rate=args.min_tool_rate,
                      min_gain=args.min_gain)
    if reasons:
        print("check_demo: FAIL: the main job did not learn: " + "; ".join(reasons))
        return 1
    b, a = result["before"][args.split], result["after"][args.split]
    print(f"check_demo: PASS ({args.split}: success {b['success_rate']:.2f} -> {a['success_rate']:.2f}, tool-call rate "
          f"{a.get('tool_call_rate', a.get('tool_share', 0.0)):.2f}; floors: success {args.min_success}, tool-call rate {args.min_tool_rate}, "
          f"gain {args.min_gain:+})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
