"""Build the ALFWorld CPU demo's shipped data from the released games (json_2.1.1): run it once, commit the output.

    python scripts/make_alfworld_demo_data.py --data DIR          # DIR: an unpacked alfworld-json_2.1.1 root

Writes ``envs/data/alfworld_demo_games.tar.xz`` -- every ``valid_seen`` / ``valid_unseen`` game of the demo's task
types plus a seeded sample of their ``train`` games, and ``logic/`` -- (``data_dir: builtin:demo`` unpacks it), and
``envs/data/alfworld_demos.jsonl.xz``: the project's two scripted players each playing every ``train`` game of those
types once through the runtime, with the demo preset's env settings and turn limit:

* ``walkthrough`` (:class:`~agentenv.envs.alfworld_expert.ALFWorldExpert`) replays the game's stored plan: it walks
  straight to the object, so its plays are short and show every skill once (take, open, deliver, use the lamp);
* ``searcher`` (``ALFWorldSearcher`` (``scripts/alfworld_searcher.py``)) knows only what the agent sees and visits
  receptacles in a random order. ``--keep all`` (the default) also keeps its lost plays: they act exactly as its won
  ones do, only its luck ran out; keeping only wins would teach where the objects were (``--keep won``).

Those plays are text (messages); the SFT warm start tokenizes them with the model's own tokenizer and chat glue,
exactly as the runtime would (``agentenv.run.sft.prepare_demos``), and ``tests/test_miniature.py`` replays some of them
against the env to prove the shipped text is still what the env says. The tarball is deterministic (sorted members,
zero mtimes and owners), so rebuilding from the same data gives the same bytes and the same cache key.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import random
import sys
import tarfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "configs" / "alfworld_demo.yaml"
OUT_GAMES = REPO / "envs" / "data" / "alfworld_demo_games.tar.xz"
OUT_DEMOS = REPO / "envs" / "data" / "alfworld_demos.jsonl.xz"


def _add_tree(tar: tarfile.TarFile, root: Path, rel: str) -> None:
    for path in sorted([root / rel, *(root / rel).rglob("*")]):
        info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
        info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
        if info.isfile():
            with open(path, "rb") as f:
                tar.addfile(info, f)
        else:
            tar.addfile(info)


def build_games(root: Path, task_types: list[str], n_train: int, seed: int) -> list[str]:
    from agentenv.envs.alfworld import list_games

    train = list_games("train", root, task_types)
    picked = sorted(random.Random(seed).sample(train, min(n_train, len(train))))
    games = list_games("valid_seen", root, task_types) + list_games("valid_unseen", root, task_types) + picked
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add_tree(tar, root, "logic")
        for g in sorted(games):
            _add_tree(tar, root, str(Path(g).parent))
    OUT_GAMES.write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    return games


def build_demos(root: Path, preset: dict, workers: int, players: list[str], out: Path = OUT_DEMOS,
                keep: str = "all") -> None:
    """Each of ``players`` on every train game of the preset's task types (``workers`` processes: textworld holds a
    global lock per process); plays written in (game, player) order, all of them or (``keep="won"``) the won ones."""
    from concurrent.futures import ProcessPoolExecutor

    from agentenv.envs.alfworld import list_games

    n = len(list_games("train", root, preset["env"]["kwargs"]["task_types"]))
    parts = [list(range(i, n, workers)) for i in range(workers)]
    rows = []
    with ProcessPoolExecutor(workers) as pool:
        for player in players:
            played = [r for part in pool.map(_play, [(str(root), preset, player, p) for p in parts]) for r in part]
            won = sum(r["success"] for r in played)
            turns = sum(r["num_turns"] for r in played) / max(1, len(played))
            print(f"{player}: {len(played)} plays, {won} won, {turns:.1f} turns on average")
            rows += played
    rows.sort(key=lambda r: (r["meta"]["game"], players.index(r["meta"]["player"])))
    kept = [r for r in rows if r["success"] or keep == "all"]
    out.write_bytes(lzma.compress("".join(json.dumps(r) + "\n" for r in kept).encode(), preset=9))
    print(f"{len(kept)} plays kept -> {out} ({out.stat().st_size / 1e6:.2f} MB)")


def _play(args) -> list[dict]:
    import gymnasium as gym

    import agentenv  # noqa: F401  (registers the envs)
    from agentenv.envs.alfworld_expert import ALFWorldExpert
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the searcher lives beside this script
    from alfworld_searcher import ALFWorldSearcher
    from agentenv.core.runtime import EpisodeSpec, RolloutConfig, run_episodes

    root, preset, player, index = args
    policy = ALFWorldSearcher(order="random") if player == "searcher" else ALFWorldExpert()
    kw = {**preset["env"]["kwargs"], "data_dir": root, "max_turns": preset["rollout"]["max_turns"], **policy.env_kwargs}

    def make_env():
        return gym.make("agentenv/ALFWorld-v0", split="train", **kw)

    tasks = [EpisodeSpec(seed=i, options={"game": i}, meta={"game": i, "player": player}) for i in index]
    cfg = RolloutConfig(max_turns=preset["rollout"]["max_turns"], concurrency=1)
    trajs = run_episodes(make_env, policy, len(tasks), cfg, tasks=tasks)
    keep = ("env", "task", "task_type", "model", "messages", "reward", "success", "terminated", "truncated",
            "finish_reason", "num_turns", "num_invalid_actions", "meta", "schema_version")
    return [{k: v for k, v in t.to_dict().items() if k in keep} for t in trajs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="an unpacked alfworld-json_2.1.1 root (json_2.1.1/ and logic/)")
    ap.add_argument("--train-games", type=int, default=128, help="train games shipped for RL (seeded sample)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-demos", action="store_true")
    ap.add_argument("--players", nargs="+", choices=("walkthrough", "searcher"), default=["walkthrough", "searcher"],
                    help="walkthrough: the stored expert plan; searcher: ALFWorldSearcher (sees only what the agent sees)")
    ap.add_argument("--demos-out", type=Path, default=OUT_DEMOS)
    ap.add_argument("--keep", choices=("won", "all"), default="all",
                    help="all: keep lost plays too (a blind searcher's lost plays search just as well; only its luck ran out)")
    ap.add_argument("--preset", type=Path, default=PRESET)
    ap.add_argument("--skip-games", action="store_true", help="keep the shipped games archive as it is")
    a = ap.parse_args()
    preset = yaml.safe_load(a.preset.read_text())
    root = Path(a.data).expanduser().resolve()
    t0 = time.perf_counter()
    if not a.skip_games:
        games = build_games(root, preset["env"]["kwargs"]["task_types"], a.train_games, a.seed)
        print(f"{len(games)} games -> {OUT_GAMES} ({OUT_GAMES.stat().st_size / 1e6:.2f} MB)")
    if not a.skip_demos:
        build_demos(root, preset, a.workers, a.players, a.demos_out, a.keep)
    print(f"done in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
