"""ALFWorld: the real ``alfworld`` TextWorld household games as an agentenv :class:`~agentenv.envs.base.TextEnv`.

Contract
--------
* One env instance plays one game per ``reset``. Games are loaded the way ``alfworld``'s ``AlfredTWEnv`` loads them:
  ``textworld.start(game.tw-pddl)`` with alfworld's ``AlfredDemangler`` (object names such as ``desk 1``, no
  shuffling) and ``AlfredInfos`` wrappers, requesting ``won`` and ``admissible_commands``.
* Data root (a folder holding ``json_2.1.1/<split>/<task>/<trial>/game.tw-pddl`` and ``logic/``): the ``data_dir``
  argument, else ``$ALFWORLD_DATA``, else ``~/.cache/alfworld`` if ``alfworld-download`` filled it, else the small
  sample shipped in ``envs/data/alfworld_sample`` (24 games, 4 per task type). ``data_dir`` may also name a shipped
  root: ``builtin:sample`` (that sample) or ``builtin:demo`` (the CPU demo's games, see :data:`DEMO_ARCHIVE`: every
  ``valid_seen`` / ``valid_unseen`` game of two task types and 128 of their train games, unpacked once into the
  agentenv cache). A split missing
  from the root is a :class:`ALFWorldDataError` that says how to get the data. Splits: ``train``, ``valid_seen``
  (alias ``seen``, 140 games), ``valid_unseen`` (alias ``unseen``, 134 games), ``valid_train``. A split's games are
  the ones ``AlfredTWEnv`` collects (a ``traj_data.json`` next to the game, marked solvable, no movable/sliced
  trials), sorted by path: that sorted list is the deterministic evaluation order.
* Game selection: ``reset(options={"game": i})`` plays the split's i-th game, ``{"game": path}`` a game by path
  (relative to the data root, or absolute; the trial folder or its ``game.tw-pddl``). Otherwise the game is drawn
  from ``self.np_random``, so ``reset(seed=s)`` picks the same game for the same ``s`` and split.
* Observation: the game text (the TextWorld banner removed), then ``Admissible actions:`` and one command per line.
  The policy answers ``<action>COMMAND</action>``, optionally after free-form reasoning; only the last such tag counts
  (see :data:`SYSTEM_PROMPT_TEMPLATE`, returned in ``info["system"]``). A reply without a tag, or with a command
  that is not admissible, leaves the game unchanged, is answered with an observation that says why, sets
  ``info["invalid_action"]`` and costs a turn; the ``invalid_action_budget``-th invalid action ends the episode
  (``terminated``, ``finish_reason="invalid_action_budget"``).
* ``nearest_match=True`` plays a tagged command that is not admissible as the admissible one closest to it in spelling
  among those with the same verb and object -- numbers and places may differ, the object acted on may not
  (:func:`nearest_command`; :data:`NEAREST_SYSTEM_PROMPT_TEMPLATE`) -- and the observation starts with
  ``(Read as "COMMAND".)``; ``info["approximate_action"]`` marks that step and ``info["approximate_actions"]`` counts
  them. A command on an object that no admissible command names (``take book 1 ...`` with no book at hand), or a
  reply without a tag, is invalid.
* ``restate_goal=True`` repeats the opening's ``Your task is to: ...`` line in every later observation, just before
  the admissible list, so the goal's object and receptacle sit next to the commands that name them. The game is the
  same; only the text grows (~12 tokens a turn).
* Reward is terminal success as in the ALFWorld paper: 1.0 on the step that wins the game (``terminated``,
  ``info["success"]=True``), else 0.0. After ``max_turns`` steps (valid or not) without a win the episode is
  ``truncated`` with ``finish_reason="max_turns"``; running out of turns is never success.
* ``info`` always has ``role``, ``task`` (game path relative to the data root), ``task_type`` (one of
  :data:`TASK_TYPES`), ``split``, ``turn``, ``invalid_actions`` (count so far), ``admissible_commands`` and
  ``success``. With ``expert=True`` it also has ``expert_action``: the next command of the game's stored walkthrough
  while the episode's game state is the one the walkthrough expects, else of a fresh plan from TextWorld's PDDL
  planner (fast-downward) for the current state. :mod:`agentenv.envs.alfworld_expert` plays it.
* Evaluation is the common one (:func:`agentenv.run.evaluation.evaluate` on the ``alfworld`` preset): every game of a
  split (:meth:`ALFWorldEnv.task_options`, in sorted order) ``eval.samples`` times, success overall and per task type.
"""

from __future__ import annotations

import difflib
import json
import logging
import os
import re
import threading
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from agentenv.envs.base import TextEnv

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
log = logging.getLogger(__name__)

SPLITS = {
    "train": "train",
    "valid_seen": "valid_seen",
    "seen": "valid_seen",
    "valid_unseen": "valid_unseen",
    "unseen": "valid_unseen",
    "valid_train": "valid_train",
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

_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
_ACTION_TAG = re.compile(r"<action>(.*?)</action>", re.DOTALL | re.IGNORECASE)

SYSTEM_PROMPT_TEMPLATE = """\
You are an agent in a household (ALFWorld). Each message tells you what you observe and ends with the list of \
admissible actions. Reply with exactly one of those actions, copied from the list, inside an action tag, for example:
<action>go to desk 1</action>
You may reason before the tag; only the last <action>...</action> in your reply is used. Case and extra spaces do \
not matter. A reply without the tag, or with an action that is not in the list, is invalid: nothing happens, it \
costs a turn, and {budget}. You have {max_turns} turns. The episode ends as soon as the task is done."""


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


def _import_alfworld():
    """``import alfworld``, tolerating an empty ``$ALFWORLD_DATA``.

    alfworld creates ``$ALFWORLD_DATA`` at import time and crashes on an empty value (``os.makedirs('')``), while
    :func:`resolve_data_root` reads empty as unset; so an empty value is dropped first, meaning the same thing to both."""
    if DATA_ENV_VAR in os.environ and not os.environ[DATA_ENV_VAR].strip():
        del os.environ[DATA_ENV_VAR]
    import alfworld

    return alfworld


def builtin_root(name: str) -> Path:
    """A shipped data root: ``sample`` (the 24-game sample folder) or ``demo`` (:data:`DEMO_ARCHIVE`, unpacked on first
    use into ``$AGENTENV_CACHE`` under a name that carries the archive's hash, so a new archive never mixes with an
    old copy)."""
    if name == "sample":
        return SAMPLE_DIR
    if name != "demo":
        raise ValueError(f"unknown shipped ALFWorld data {BUILTIN_PREFIX}{name}; expected builtin:sample or builtin:demo")
    import hashlib
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


def list_games(split: str, data_dir: str | os.PathLike | None = None, task_types: Iterable[str] | None = None) -> list[str]:
    """Games of ``split`` (paths relative to the data root, sorted), optionally only some task types (short or
    ALFRED names). Raises :class:`ALFWorldDataError` when the split is absent or empty."""
    root = resolve_data_root(data_dir)
    split = canonical_split(split)
    games = list(_collect_games(root, split))
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
    return games


# nearest_match=True: a command that is not admissible is read as the admissible command closest to it in spelling
# (difflib's ratio), as LLM planners map free text onto a game's actions (e.g. Huang et al. 2022), but only among the
# commands that do the same thing to the same object: read by spelling alone, "take book 1 from drawer 2" at a drawer
# holding a watch became "take watch 1 from drawer 2", which plays an object the agent never named and makes the
# reward depend on the matcher. The agent is told which command was played. The CPU demo uses it because its tiny
# model often gets a receptacle's number wrong while naming the right object.
NEAREST_SYSTEM_PROMPT_TEMPLATE = """\
You are an agent in a household (ALFWorld). Each message tells you what you observe and ends with the list of \
admissible actions. Reply with exactly one of those actions, copied from the list, inside an action tag, for example:
<action>go to desk 1</action>
You may reason before the tag; only the last <action>...</action> in your reply is used. Case and extra spaces do \
not matter. An action that is not in the list is read as the listed action closest to it in spelling that does \
the same to the same object, and you are told which one was played; an action on an object that no listed action \
names is invalid. A reply without the tag is invalid: nothing happens, it costs a turn, and {budget}. You \
have {max_turns} turns. The episode ends as soon as the task is done."""


# compact_list=True: a prompt as short as the list (every token of it is paid in every trajectory, ~25% of a short
# episode with the long prompts above).
COMPACT_SYSTEM_PROMPT_TEMPLATE = """\
You are an agent in a household (ALFWorld). Reply with one action in a tag, e.g. <action>go to desk 1</action>; you \
may think first, the last tag counts. You can go to any receptacle in the room, look and inventory; each message \
lists the other admissible actions. {matching} A reply without a tag is invalid and costs a turn; {budget}. You have \
{max_turns} turns."""
COMPACT_MATCHING = {True: "An action that is not admissible is read as the closest admissible one on the same object, "
                          "and you are told; with no such one it is invalid.",
                    False: "An action that is not admissible is invalid and costs a turn."}


# The goal as ALFWorld states it in a game's opening text (one line); restate_goal=True repeats it every turn.
_GOAL_LINE = re.compile(r"^Your task is to: .*$", re.MULTILINE)


def _task_type_from_path(game: str) -> str | None:
    # Task folders are named <task_type>-<object>-<movable recep>-<parent recep>-<scene>.
    return TASK_TYPES.get(Path(game).parent.parent.name.split("-", 1)[0])


def parse_action(text: str) -> str | None:
    """The command in the last ``<action>...</action>`` tag, lower-cased with whitespace collapsed and a trailing
    period dropped; ``None`` when there is no tag or it is empty."""
    tags = _ACTION_TAG.findall(text)
    if not tags:
        return None
    command = " ".join(tags[-1].split()).lower().rstrip(".").strip()
    return command or None


# textworld is not thread-safe: its grammar and PDDL parsers are module-global tatsu parser objects, and
# fast-downward's translator writes module-global options and sys.argv. The runtime steps envs on several threads, so
# every call into textworld goes through this one lock (that work holds the GIL anyway: little throughput is lost).
_TEXTWORLD_LOCK = threading.RLock()


# Whether the game being loaded will ever plan. textworld translates every game twice: the plain SAS it plays, and
# an "optimized" one (pruned facts and operators) that only its planner (``PddlState.replan``) reads. An env that
# requests no plan (no expert, no walkthrough, no policy_commands) sets this around its load and reset, and the
# optimized call is answered with the plain translation: a valid SAS that is loaded and never searched. It halves the
# cost of a game's first load, which a run over the 1,098 train games pays on most episodes. Only read and written
# while ``_TEXTWORLD_LOCK`` is held, so one flag serves every thread.
_PLANS = [True]


@lru_cache(maxsize=1)
def _install_translation_memo() -> None:
    """Replace ``fast_downward.pddl2sas`` (process-wide, once) by a memoized version.

    Why: the PDDL-to-SAS translation is ~90% of a reset and textworld runs it four times per new game (twice in
    ``load``, twice in ``reset``) on the same inputs; its result is only read afterwards, so reusing it is exact.
    It keeps the last 512 translations (~1.2 MB each; one per game that will not plan, see ``_PLANS``, two per game
    that will): a reset of a kept game takes ~0.06 s instead of ~0.35 s, and the CPU demo's 128 train and 90 eval
    games all stay.
    Its callers here hold ``_TEXTWORLD_LOCK``; the memo takes it too for any other caller."""
    import fast_downward

    original = fast_downward.pddl2sas

    @lru_cache(maxsize=512)  # two entries per game when it plans (plain and optimized), one when it does not
    def _translate(domain: str, problem: str, verbose: bool, optimize: bool):
        return original(domain, problem, verbose=verbose, optimize=optimize)

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        with _TEXTWORLD_LOCK:
            return _translate(domain, problem, verbose, optimize and _PLANS[0])

    fast_downward.pddl2sas = pddl2sas


# compact_list=True: the commands every state of every game admits are not listed one by one. `go to R` is admissible
# for every receptacle R of the room but the one the agent stands at (the opening text names them all), and these
# three never change the game. Listing them costs ~5 tokens per receptacle per turn, ~70% of a turn's observation.
ALWAYS_ADMISSIBLE = ("help", "inventory", "look")
GO_TO_LINE = "go to <any receptacle in the room>"


@lru_cache(maxsize=1)
def _install_parse_memos() -> None:
    """Memoize textworld's two tatsu parsers (process-wide, once): text generation's grammar symbols and the logic's
    conjunctive queries; copy text generation's contexts shallowly; and build a game's logic once.

    Why: every step re-parses the same few hundred template and query strings (~45% of a step). Parsing is a pure
    function of the string. Text generation mutates the symbols it gets (it sets their context), so each call returns
    a deep copy of the memoized parse -- the same objects a fresh parse would give, at a fraction of the cost. A
    query's ``Rule`` is only read (``State.all_assignments`` copies the mapping it is given), so the one parsed rule
    is shared.

    And make text generation's context copy shallow. ``textgen.copy_context`` deep-copies a context's ``variables``
    (placeholder name -> the game's ``EntityInfo``) and ``mapping`` (placeholder -> variable) ~30 times per generated
    sentence; ~75% of a step went there. Derivation only adds keys to the copied dicts (``query`` updates them) and
    reads the values (``{o.name}`` templates); the ``EntityInfo`` objects are the ones the context's shared
    ``entity_infos`` already holds, and placeholders and variables are hashable value objects. A copy of the two dicts
    is therefore what a deep copy gives for every read the grammar makes. Together: a step ~45 -> ~5 ms, a reset of
    a game played before ~65 -> ~35 ms, observations byte-identical
    (``test_parse_memos_leave_every_observation_unchanged``)."""
    import copy

    import textworld.envs.pddl.logic as pddl_logic
    import textworld.envs.pddl.textgen as textgen
    import textworld.logic as logic

    def memoized(parse):
        @lru_cache(maxsize=8192)
        def cached(text: str, rule_name: str):
            return parse(text, rule_name=rule_name)

        def parse_copy(text, rule_name, **kwargs):
            if kwargs.get("trace"):  # TW_CSG_TRACE debugging wants to see the parse itself
                return parse(text, rule_name=rule_name, **kwargs)
            return copy.deepcopy(cached(text, rule_name))

        return parse_copy

    textgen._parse_and_convert = memoized(textgen._parse_and_convert)
    original_query = logic.Rule.parse_conjunctive_query.__func__
    cached_query = lru_cache(maxsize=8192)(lambda expr: original_query(logic.Rule, expr))
    logic.Rule.parse_conjunctive_query = classmethod(lambda cls, expr: cached_query(expr))

    def copy_context(context: dict) -> dict:
        return {"state": context["state"], "facts": context["facts"], "variables": dict(context["variables"]),
                "mapping": dict(context["mapping"]), "entity_infos": context["entity_infos"]}

    textgen.copy_context = copy_context  # the module global its symbols and grammar call

    # A game's logic (its action templates and text grammar, parsed from the game file) is rebuilt by every load,
    # ~25 ms of a ~60 ms reset of a game the env did not just play. It is only read once built (a state adds the
    # domain's types to it, which it already has after the first), so one per (domain, grammar) is shared.
    original_logic = pddl_logic.GameLogic
    shared_logic = lru_cache(maxsize=512)(lambda domain, grammar: original_logic(domain=domain, grammar=grammar))
    pddl_logic.GameLogic = lambda domain, grammar: shared_logic(domain, grammar)


def _format_commands(commands: list[str], compact: bool = False) -> str:
    if compact:
        commands = [GO_TO_LINE] + [c for c in commands if not c.startswith("go to ") and c not in ALWAYS_ADMISSIBLE]
    return "Admissible actions:\n" + "\n".join(commands)


def _verb_and_object(command: str) -> tuple[str, str]:
    """``("take", "book")`` for "take book 1 from desk 2", ``("go to", "desk")`` for "go to desk 1": what a command
    does and to what, without the numbers and places that :func:`nearest_command` may approximate."""
    words = command.split()
    if words[:2] == ["go", "to"]:
        return "go to", words[2] if len(words) > 2 else ""
    return (words[0] if words else ""), (words[1] if len(words) > 1 else "")


def nearest_command(command: str, commands: list[str]) -> str | None:
    """The admissible command closest to ``command`` in spelling (difflib ratio; the first listed wins a tie) among
    those with the same verb and the same object: "take book 3 from shelf 1" may be read as "take book 1 from
    desk 2", never as "take watch 1 from shelf 1". Taking, moving or using another object than the one named cannot be
    undone within a short episode, so a command whose object is not at hand has no nearest one (``None``: invalid).
    ``help`` is never chosen: it changes nothing."""
    verb_object = _verb_and_object(command.lower())
    candidates = [c for c in commands if c != "help" and _verb_and_object(c.lower()) == verb_object]
    if not candidates:
        return None
    ratio = lambda c: difflib.SequenceMatcher(None, command, c, autojunk=False).ratio()  # noqa: E731
    return max(candidates, key=ratio)


def resolve_command(reply: str, commands: list[str], nearest: bool = False) -> tuple[str | None, str | None]:
    """``(command, None)`` for an admissible reply, else ``(None, why)``: the observation text for an invalid one.
    With ``nearest``, a tagged
    command that is not admissible resolves to :func:`nearest_command` (the caller compares it with
    :func:`parse_action` to tell the agent)."""
    command = parse_action(reply)
    if command is None:
        return None, "Invalid action: your reply has no <action>...</action> tag. Nothing happens."
    if command not in commands:
        if nearest:
            if (near := nearest_command(command, commands)) is not None:
                return near, None
            verb, obj = _verb_and_object(command)
            return None, (f'Invalid action: "{command}" is not one of the admissible actions, and none of them is '
                          f'"{verb} {obj} ...". Nothing happens.')
        return None, f'Invalid action: "{command}" is not one of the admissible actions. Nothing happens.'
    return command, None


class ALFWorldEnv(TextEnv):
    """One ALFWorld game per episode; see the module docstring for the contract."""

    metadata = {**TextEnv.metadata, "agentenv": {"preset": "alfworld"}}
    FULL_SPLIT_SIZES = {"train": 3553, "valid_seen": 140, "valid_unseen": 134}

    def __init__(
        self,
        split: str = "train",
        data_dir: str | os.PathLike | None = None,
        max_turns: int = 50,
        invalid_action_budget: int | None = 10,
        task_types: Iterable[str] | None = None,
        expert: bool = False,
        nearest_match: bool = False,
        restate_goal: bool = False,
        compact_list: bool = False,
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if invalid_action_budget is not None and invalid_action_budget < 1:
            raise ValueError(f"invalid_action_budget must be >= 1 or None (unlimited), got {invalid_action_budget}")
        self.split = canonical_split(split)
        self.data_root = resolve_data_root(data_dir)
        self.games = list_games(self.split, self.data_root, task_types)
        self.max_turns = max_turns
        self.invalid_action_budget = invalid_action_budget
        self.expert = expert
        self.nearest_match = bool(nearest_match)
        self.restate_goal = bool(restate_goal)
        self.compact_list = bool(compact_list)
        budget = (
            f"after {invalid_action_budget} invalid actions the episode ends"
            if invalid_action_budget is not None
            else "invalid actions are not otherwise limited"
        )
        template = (COMPACT_SYSTEM_PROMPT_TEMPLATE if self.compact_list
                    else NEAREST_SYSTEM_PROMPT_TEMPLATE if self.nearest_match else SYSTEM_PROMPT_TEMPLATE)
        self.system_prompt = template.format(budget=budget, max_turns=max_turns,
                                             matching=COMPACT_MATCHING[self.nearest_match])
        self._tw_env = None  # one textworld env, reloaded per game: each one dlopens its own copy of fast-downward
        self._loaded_game: Path | None = None
        self._state = None
        self._done = True

    # ----------------------------------------------------------------------------------------------- game loading
    def _textworld_env(self):
        if self._tw_env is None:
            import textworld

            _import_alfworld()
            from alfworld.agents.environment.alfred_tw_env import (
                AlfredDemangler,
                AlfredInfos,
            )
            from textworld.envs.pddl import PddlEnv

            _install_translation_memo()
            _install_parse_memos()
            # The walkthrough is only requested for the expert: for a game without a stored one, textworld would
            # run the planner at every reset.
            extras = ["gamefile", "walkthrough"] if self.expert else ["gamefile"]
            infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=extras)
            # What textworld.start(path, infos, wrappers) builds, minus the load: games are loaded per reset.
            self._tw_env = AlfredInfos(AlfredDemangler(shuffle=False)(PddlEnv(infos)))
        return self._tw_env

    def _resolve_game(self, game: Any) -> Path:
        if isinstance(game, (int,)) and not isinstance(game, bool):
            if not -len(self.games) <= game < len(self.games):
                raise IndexError(f"game index {game} out of range for split {self.split!r} ({len(self.games)} games)")
            return self.data_root / self.games[game]
        if isinstance(game, (str, os.PathLike)):
            path = Path(game)
            path = path if path.is_absolute() else self.data_root / path
            if path.is_dir():
                path = path / GAME_FILE
            if not path.is_file():
                raise FileNotFoundError(f"no ALFWorld game at {str(path)!r}")
            return path.resolve()
        raise TypeError(f'options["game"] must be a game index (int) or a path (str), got {type(game).__name__}')

    def _task_name(self, path: Path) -> str:
        try:
            return path.relative_to(self.data_root).as_posix()
        except ValueError:
            return str(path)

    # --------------------------------------------------------------------------------------------- gym interface
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        with _TEXTWORLD_LOCK:
            return self._reset(options or {})

    def _reset(self, options: dict) -> tuple[str, dict]:
        self._done = True  # until this reset has succeeded
        if "game" in options:
            path = self._resolve_game(options["game"])
        else:
            path = self.data_root / self.games[int(self.np_random.integers(len(self.games)))]
        env = self._textworld_env()
        _PLANS[0] = self.expert  # the walkthrough / replan of an expert read the optimized translation
        try:
            if path != self._loaded_game:
                self._loaded_game = None
                env.load(str(path))
                self._loaded_game = path
            self._state = env.reset()
        finally:
            _PLANS[0] = True
        with open(path.parent / TRAJ_FILE) as f:
            alfred_type = json.load(f)["task_type"]
        if alfred_type not in TASK_TYPES:
            raise ValueError(f"{path.parent / TRAJ_FILE}: unknown task_type {alfred_type!r}")
        self._task = self._task_name(path)
        self._task_type = TASK_TYPES[alfred_type]
        self._turn = 0
        self._invalid = 0
        self._approximate = 0
        self._done = False
        if self.expert:
            self._plan = list(self._state["extra.walkthrough"] or [])
            self._plan_pos = 0
        intro = self._state.feedback.replace(_BANNER, "").strip()
        goal = _GOAL_LINE.search(intro)
        self._goal_line = goal.group(0).strip() if goal else None
        obs = f"{intro}\n\n{self._commands_text()}"
        info = self._info(success=False)
        info["system"] = self.system_prompt
        self._last_text = obs
        return obs, info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._done:
            raise RuntimeError("step() called on a finished or never-started ALFWorld episode; call reset() first")
        if not isinstance(action, str):
            raise TypeError(f"action must be the assistant's message text (str), got {type(action).__name__}")
        with _TEXTWORLD_LOCK:
            return self._step(action)

    def _step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self._turn += 1
        command, text = resolve_command(action, self._state.admissible_commands, self.nearest_match)
        invalid = command is None
        written = parse_action(action)
        approximate = not invalid and written != command
        if invalid:
            self._invalid += 1
        else:
            self._approximate += approximate
            self._play(command)
            text = self._state.feedback.strip()
            if approximate:
                text = f'(Read as "{command}".) {text}'
        won = bool(self._state.won)
        terminated = truncated = False
        finish_reason = None
        if won:
            terminated, finish_reason = True, "done"
        elif self.invalid_action_budget is not None and self._invalid >= self.invalid_action_budget:
            terminated, finish_reason = True, "invalid_action_budget"
            text += f" That was invalid action {self._invalid} of {self.invalid_action_budget} allowed: the episode ends."
        elif self._turn >= self.max_turns:
            truncated, finish_reason = True, "max_turns"
            text += f" That was the last of {self.max_turns} turns: the episode ends."
        self._done = terminated or truncated
        if not self._done and self.restate_goal and self._goal_line:
            text = f"{text}\n\n{self._goal_line}"
        obs = text if self._done else f"{text}\n\n{self._commands_text()}"
        info = self._info(success=won)
        info["invalid_action"] = invalid
        info["approximate_action"] = approximate
        if finish_reason is not None:
            info["finish_reason"] = finish_reason
        self._last_text = obs
        return obs, 1.0 if won else 0.0, terminated, truncated, info

    def close(self) -> None:
        if self._tw_env is not None:
            with _TEXTWORLD_LOCK:
                self._tw_env.close()
            self._tw_env = None
            self._loaded_game = None
        super().close()

    def _commands_text(self) -> str:
        return _format_commands(self._state.admissible_commands, self.compact_list)

    def _info(self, success: bool) -> dict:
        info = {
            "role": "user",
            "task": self._task,
            "task_type": self._task_type,
            "split": self.split,
            "turn": self._turn,
            "invalid_actions": self._invalid,
            "approximate_actions": self._approximate,
            "admissible_commands": list(self._state.admissible_commands),
            "success": success,
        }
        if self.expert and not self._done:
            info["expert_action"] = self._expert_action()
        return info

    # ------------------------------------------------------------------------------------------------ expert plan
    def _pddl(self):
        core = self._tw_env.unwrapped  # textworld's PddlEnv; _pddl_state/_entity_infos are its (pinned) internals
        return core._pddl_state, core._entity_infos

    def _play(self, command: str) -> None:
        facts_before = None
        if self.expert and self._plan is not None:
            if self._plan_pos < len(self._plan) and self._plan[self._plan_pos] == command:
                self._plan_pos += 1
            else:
                facts_before = set(self._pddl()[0].facts)
        self._state, _, _ = self._tw_env.step(command)
        # Off plan: a command that leaves the PDDL state as it was (look, inventory, examine...) keeps the plan
        # valid; anything else drops it and the next expert_action replans from the new state.
        if facts_before is not None and set(self._pddl()[0].facts) != facts_before:
            self._plan = None

    # ------------------------------------------------------------------------------------- what the harness asks
    def task_options(self) -> list[dict]:
        """One task per game of this env's split, in the split's sorted order."""
        return [{"game": i} for i in range(len(self.games))]

    @classmethod
    def preflight(cls, *, splits, data_dir=None, task_types=None, **_) -> list:
        """The alfworld package, and games for every split the run will train or evaluate on."""
        from agentenv.envs.spec import Check

        out = []
        for split in dict.fromkeys(s or "train" for s in splits):
            try:
                games = list_games(split, data_dir, task_types)
                full = cls.FULL_SPLIT_SIZES.get(canonical_split(split))
                # a sample is a root with fewer games of all types than the release; a task_types filter on the
                # full release is not (1,098 pick/look games of 3,553 is every one of them)
                note = (f" (the full split has {full}: set $ALFWORLD_DATA for paper numbers)"
                        if full and len(list_games(split, data_dir)) < full else "")
                out.append(Check(f"alfworld {split}", True,
                                 f"{len(games)} games under {resolve_data_root(data_dir)}{note}"))
            except Exception as e:  # noqa: BLE001 -- reported, not raised: a dry run shows every problem at once
                out.append(Check(f"alfworld {split}", False, str(e)))
        try:
            _import_alfworld()
            out.append(Check("alfworld package", True, "importable"))
        except ImportError:
            out.append(Check("alfworld package", False, "pip install 'agentenv[alfworld]' (needs a C++ compiler)"))
        except Exception as e:  # noqa: BLE001 -- alfworld runs code at import (it creates its data folder)
            out.append(Check("alfworld package", False, f"import alfworld failed: {type(e).__name__}: {e}"))
        return out

    def _expert_action(self) -> str | None:
        if self._plan is None or self._plan_pos >= len(self._plan):
            pddl_state, entity_infos = self._pddl()
            self._plan, self._plan_pos = list(pddl_state.replan(entity_infos)), 0
        if self._plan_pos >= len(self._plan):
            return None  # the planner found no plan from here
        return self._plan[self._plan_pos]
