"""What the resumable studies (``ablations.py``, ``alfworld_confirm.py``, ``demo_stability.py``) share: the
``--parts I/N`` slice of what is left, and one design per study root.

Contract: :func:`parse_parts` turns ``"I/N"`` into ``(I, N)`` or raises argparse's error naming the rule.
:func:`one_design` keeps ``ROOT/settings.json``: the first run writes it; a later run whose design differs is
refused with one line naming each differing key (parts run elsewhere or later must not mix designs into one table);
a report-only call writes nothing and gets the saved design back, so its table describes the runs it reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_parts(text: str) -> tuple[int, int]:
    i, n = (int(x) for x in text.split("/"))
    if not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"--parts {text}: want I/N with 1 <= I <= N")
    return i, n


def one_design(root: Path, now: dict, *, study: str, report_only: bool) -> dict:
    """The design the study under ``root`` runs by (see the module docstring); ``now`` is this call's."""
    path = root / "settings.json"
    if not path.exists():
        if not report_only:
            path.write_text(json.dumps(now, indent=2))
        return now
    was = json.loads(path.read_text())
    if report_only:
        return {**now, **{k: was[k] for k in now if k in was}}
    differ = [k for k in now if was.get(k) != now[k]]
    if differ:
        raise SystemExit(f"{study}: {root} holds runs of another design ("
                         + ", ".join(f"{k}: {was.get(k)} there, {now[k]} here" for k in differ)
                         + "): pass the same options, or another --root")
    return now
