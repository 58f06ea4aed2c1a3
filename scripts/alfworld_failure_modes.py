"""Where a run's ALFWorld episodes were lost: every trajectory of ``RUN/trajectories.jsonl``, block by block.

    python scripts/alfworld_failure_modes.py RUN_DIR [--blocks 3]

Each episode of a pick-and-place or look-at-in-light game falls in exactly one row, by the first thing that went
wrong for the object its task names (read from the opening's "Your task is to: ..." line, as
``alfworld_searcher.parse_goal``, beside this script, reads it):

* ``won``;
* ``took another object first``: the first object picked up was not the goal's -- ``swapped`` counts those where the
  policy's command named yet another object and the env's nearest matching picked this one (possible under the old
  spelling-only rule; today's rule keeps the named object, docs/experiments/alfworld_demo_log.md "Tenth pass");
* ``took it, did not finish``: the goal's object in hand, the task not done;
* ``saw it, never took it``: the goal's object appeared in an observation, never picked up;
* ``never saw it``.

Beside them: invalid actions per episode and how episodes ended (``finish_reason``). Other task types are counted as
``other`` and not sorted. Reads only what a run already wrote; needs ``run.save_trajectories`` (on by default).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

from agentenv.envs.alfworld import parse_action

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the searcher lives beside this script
from alfworld_searcher import parse_goal  # noqa: E402

ROWS = ["won", "took another object first", "took it, did not finish", "saw it, never took it", "never saw it"]
HEADS = dict(zip(ROWS, ["won", "other obj first", "goal, unfinished", "saw, not taken", "never saw"]))
_PICKUP = re.compile(r"You pick up the (\S+) \d+")


def failure_mode(messages: list[dict], success: bool) -> tuple[str, bool]:
    """(row, whether the first pickup's object was swapped by matching) for one episode's messages."""
    turns = [m for m in messages if m["role"] in ("user", "assistant")]
    observations = [m["content"] for m in turns if m["role"] == "user"]
    try:
        _, goal_object, _ = parse_goal(observations[0])
    except (ValueError, IndexError):
        return "other", False
    if success:
        return "won", False
    seen = False
    for i, turn in enumerate(turns):
        if turn["role"] != "user":
            continue
        scene = turn["content"].split("Your task is to:")[0]
        if (m := _PICKUP.search(scene)) is not None:
            if m.group(1) != goal_object:
                written = parse_action(turns[i - 1]["content"]) if i and turns[i - 1]["role"] == "assistant" else None
                named = written.split()[1] if written and len(written.split()) > 1 else None
                return "took another object first", named != m.group(1)
            return "took it, did not finish", False
        seen = seen or re.search(rf"\b{re.escape(goal_object)} \d", scene) is not None
    return ("saw it, never took it" if seen else "never saw it"), False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--blocks", type=int, default=3, help="consecutive blocks of trajectories (training order)")
    args = ap.parse_args(argv)
    path = args.run_dir / "trajectories.jsonl"
    if not path.exists():
        print(f"{path}: not found (the run needs run.save_trajectories=true)", file=sys.stderr)
        return 2
    trajs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not trajs:
        print(f"{path}: no trajectories", file=sys.stderr)
        return 2
    size = -(-len(trajs) // max(1, args.blocks))
    print(f"{path}: {len(trajs)} trajectories; shares of each block's episodes")
    print(f"{'block':>13s} " + " ".join(f"{HEADS[r]:>16s}" for r in ROWS) + f"{'(swapped)':>10s}{'invalid/ep':>11s}  ends")
    for start in range(0, len(trajs), size):
        block = trajs[start:start + size]
        rows, swapped, ends = collections.Counter(), 0, collections.Counter()
        for t in block:
            row, was_swapped = failure_mode(t["messages"], bool(t["success"]))
            rows[row] += 1
            swapped += was_swapped
            ends[t.get("finish_reason")] += 1
        n = len(block)
        invalid = sum(t.get("num_invalid_actions", 0) for t in block) / n
        ended = ", ".join(f"{k} {v / n:.2f}" for k, v in ends.most_common())
        print(f"{start + 1:>6d}-{start + n:<6d} " + " ".join(f"{rows[r] / n:16.2f}" for r in ROWS)
              + f"{swapped / n:10.2f}{invalid:11.2f}  {ended}" + (f"  (other {rows['other']})" if rows["other"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
