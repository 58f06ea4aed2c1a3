"""Where the ALFWorld games are and which ones a split holds (no textworld import: cheap to call anywhere).

Contract: :func:`resolve_data_root` picks the data root (``data_dir``, else ``$ALFWORLD_DATA``, else
``~/.cache/alfworld`` when ``alfworld-download`` filled it, else the shipped sample; ``builtin:sample`` /
``builtin:demo`` name the shipped games, the demo's unpacked once into the agentenv cache). :func:`list_games` lists a
split's games as ``AlfredTWEnv`` collects them, sorted by path (the deterministic evaluation order), optionally only
some task types. Missing data is an :class:`ALFWorldDataError` that says how to get it.
``dev_games=N`` carves a dev split out of train: the N train games (of the chosen task types) whose path hashes
lowest (:func:`dev_and_train`: stable, whatever order the files are found in). Split ``dev`` is those games and split
``train`` the rest, so tuning on ``dev`` never touches a game RL trains on, nor valid_seen / valid_unseen.
:mod:`agentenv.envs.alfworld` (the env) re-exports these names.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

DATA_ENV_VAR = "ALFWORLD_DATA"
SAMPLE_DIR = Path(__file__).resolve().parent / "data" / "alfworld_sample"
GAMES_SUBDIR = "json_2.1.1"
GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
_ALFWORLD_DEFAULT_CACHE = Path("~/.cache/alfworld").expanduser()  # alfworld.info's default for $ALFWORLD_DATA
# The demo's games as one xz tarball (~0.3 MB; the same games unpacked are ~15 MB): made by
# scripts/make_alfworld_demo_data.py from the released json_2.1.1 archive.
DEMO_ARCHIVE = Path(__file__).resolve().parent / "data" / "alfworld_demo_games.tar.xz"
BUILTIN_PREFIX = "builtin:"

SPLITS = {
    "train": "train",
    "valid_seen": "valid_seen",
    "seen": "valid_seen",
    "valid_unseen": "valid_unseen",
    "unseen": "valid_unseen",
    "valid_train": "valid_train",
    "dev": "dev",  # train games held out from RL (needs dev_games=N: see dev_and_train)
}

# ALFRED's task_type (traj_data.json, task folder prefix) -> the short name recorded in info["task_type"].
TASK_TYPES = {
    "pick_and_place_simple": "pick_and_place",
    "pick_clean_then_place_in_recep": "pick_clean_then_place",
    "pick_heat_then_place_in_recep": "pick_heat_then_place",
    "pick_cool_then_place_in_recep": "pick_cool_then_place",
    "look_at_obj_in_light": "look_at_obj_in_light",
    "pick_two_obj_and_place": "pick_two_obj_and_place",
}


class ALFWorldDataError(FileNotFoundError):
    """The ALFWorld games asked for are not where the env looked."""


def _how_to_get_data(what: str) -> str:
    return (
        f"{what}\nGet the ALFWorld games (json_2.1.1) in one of these ways, then pass data_dir=DIR or set "
        f"${DATA_ENV_VAR}=DIR:\n"
        f"  * online: `pip install alfworld==0.4.2 && alfworld-download` (downloads to ~/.cache/alfworld; "
        f"DIR=~/.cache/alfworld)\n"
        f"  * from an archive: `tar -xJf alfworld-json_2.1.1.tar.xz -C DIR`\n"
        f"DIR must contain {GAMES_SUBDIR}/<split>/... and logic/."
    )


def resolve_data_root(data_dir: str | os.PathLike | None = None) -> Path:
    """The data root to use: ``data_dir``, else ``$ALFWORLD_DATA``, else ``~/.cache/alfworld`` when
    ``alfworld-download`` has put games there, else the shipped sample.

    A folder that is itself ``json_2.1.1`` is accepted too (its parent is the root), and ``builtin:sample`` /
    ``builtin:demo`` name the shipped games."""
    if isinstance(data_dir, str) and data_dir.startswith(BUILTIN_PREFIX):
        return builtin_root(data_dir[len(BUILTIN_PREFIX):])
    env_value = os.environ.get(DATA_ENV_VAR)
    # Importing alfworld sets $ALFWORLD_DATA to its download cache when unset (alfworld/info.py), so that value is
    # treated as the download-cache step below: the answer must not depend on whether alfworld was imported yet.
    if env_value and Path(env_value).expanduser() == _ALFWORLD_DEFAULT_CACHE:
        env_value = None
    if data_dir is not None:
        source, root = "data_dir", Path(data_dir).expanduser()
    elif env_value:
        source, root = f"${DATA_ENV_VAR}", Path(env_value).expanduser()
    elif (_ALFWORLD_DEFAULT_CACHE / GAMES_SUBDIR).is_dir():
        return _ALFWORLD_DEFAULT_CACHE.resolve()
    else:
        _warn_sample_once()
        return SAMPLE_DIR
    if root.name == GAMES_SUBDIR and not (root / GAMES_SUBDIR).is_dir():
        root = root.parent
    if not (root / GAMES_SUBDIR).is_dir():
        raise ALFWorldDataError(_how_to_get_data(f"{source}={str(root)!r} has no {GAMES_SUBDIR}/ folder."))
    return root.resolve()


def builtin_root(name: str) -> Path:
    """A shipped data root: ``sample`` (the 24-game sample folder) or ``demo`` (:data:`DEMO_ARCHIVE`, unpacked on first
    use into ``$AGENTENV_CACHE`` under a name that carries the archive's hash, so a new archive never mixes with an
    old copy)."""
    if name == "sample":
        return SAMPLE_DIR
    if name != "demo":
        raise ValueError(f"unknown shipped ALFWorld data {BUILTIN_PREFIX}{name}; expected builtin:sample or builtin:demo")
    import tarfile

    from agentenv.core.cache import atomic_dir, cache_dir

    if not DEMO_ARCHIVE.is_file():
        raise ALFWorldDataError(f"the shipped demo games {DEMO_ARCHIVE} are missing (a broken install?)")
    digest = hashlib.sha256(DEMO_ARCHIVE.read_bytes()).hexdigest()[:12]

    def unpack(out: Path) -> None:
        with tarfile.open(DEMO_ARCHIVE, "r:xz") as tar:
            tar.extractall(out, filter="data")  # "data": no absolute paths, links or devices out of the archive

    return atomic_dir(cache_dir() / f"alfworld-demo-{digest}", unpack).resolve()


@lru_cache(maxsize=1)
def _warn_sample_once() -> None:
    log.warning("ALFWorld: no data_dir, $%s or downloaded games; using the 24-game sample in %s", DATA_ENV_VAR, SAMPLE_DIR)


def canonical_split(split: str) -> str:
    try:
        return SPLITS[split]
    except KeyError:
        raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {sorted(SPLITS)}") from None


@lru_cache(maxsize=32)
def _collect_games(root: Path, split: str) -> tuple[str, ...]:
    # The same filter as alfworld's AlfredTWEnv.collect_game_files, so a split has its usual number of games.
    split_dir = root / GAMES_SUBDIR / split
    games = []
    for game in split_dir.glob(f"*/*/{GAME_FILE}"):
        trial = game.parent
        if "movable" in str(trial) or "Sliced" in str(trial) or not (trial / TRAJ_FILE).is_file():
            continue
        with open(game) as f:
            if not json.load(f).get("solvable", False):
                continue
        games.append(game.relative_to(root).as_posix())
    return tuple(sorted(games))


def list_games(split: str, data_dir: str | os.PathLike | None = None, task_types: Iterable[str] | None = None,
               dev_games: int = 0) -> list[str]:
    """Games of ``split`` (paths relative to the data root, sorted), optionally only some task types (short or
    ALFRED names); with ``dev_games`` = N > 0, ``train`` lacks the N games of split ``dev``. Raises
    :class:`ALFWorldDataError` when the split is absent or empty."""
    root = resolve_data_root(data_dir)
    split = canonical_split(split)
    if split == "dev" and dev_games < 1:
        raise ValueError("split 'dev' is carved out of train: set the env kwarg dev_games=N (e.g. --set "
                         "env.kwargs.dev_games=16), the number of train games held out from RL")
    games = list(_collect_games(root, "train" if split == "dev" else split))
    if not games:
        where = "the shipped sample" if root == SAMPLE_DIR else str(root)
        raise ALFWorldDataError(_how_to_get_data(f"No ALFWorld games for split {split!r} in {where}."))
    if task_types is not None:
        wanted = {TASK_TYPES.get(t, t) for t in task_types}
        unknown = wanted - set(TASK_TYPES.values())
        if unknown:
            raise ValueError(f"unknown task types {sorted(unknown)}; expected some of {sorted(TASK_TYPES.values())}")
        games = [g for g in games if _task_type_from_path(g) in wanted]
        if not games:
            raise ALFWorldDataError(f"split {split!r} in {root} has no games of task types {sorted(wanted)}")
    if split in ("train", "dev") and dev_games:
        dev, train = dev_and_train(games, dev_games)
        games = dev if split == "dev" else train
    return games


def dev_and_train(train_games: list[str], n: int) -> tuple[list[str], list[str]]:
    """(dev, rest), each sorted: dev is the ``n`` games whose path's SHA-256 is lowest -- a fixed pseudo-random
    choice that depends on the games only, not on their order or the run's seed."""
    if not 0 < n < len(train_games):
        raise ValueError(f"dev_games={n}: want 1 <= dev_games < {len(train_games)} (the train games of these types)")
    dev = set(sorted(train_games, key=lambda g: hashlib.sha256(g.encode()).hexdigest())[:n])
    return sorted(dev), sorted(g for g in train_games if g not in dev)


def _task_type_from_path(game: str) -> str | None:
    # Task folders are named <task_type>-<object>-<movable recep>-<parent recep>-<scene>.
    return TASK_TYPES.get(Path(game).parent.parent.name.split("-", 1)[0])
