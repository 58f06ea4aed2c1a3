"""ALFWorld: the real ``alfworld`` TextWorld household games as an agentenv :class:`~agentenv.envs.base.TextEnv`.

Contract
--------
* One env instance plays one game per ``reset``. Games are loaded the way ``alfworld``'s ``AlfredTWEnv`` loads them:
  ``textworld.start(game.tw-pddl)`` with alfworld's ``AlfredDemangler`` (object names such as ``desk 1``, no
  shuffling) and ``AlfredInfos`` wrappers, requesting ``won`` and ``admissible_commands``.
* Data root and splits: :mod:`agentenv.envs.alfworld_data` (``data_dir``, else ``$ALFWORLD_DATA``, else
  ``~/.cache/alfworld``, else the shipped sample; ``builtin:sample`` / ``builtin:demo``); a split missing from the
  root is a :class:`ALFWorldDataError` that says how to get the data. ``dev_games=N`` holds N train games out of
  ``train`` as split ``dev`` (:func:`~agentenv.envs.alfworld_data.dev_and_train`). A split's games, sorted by path,
  are its deterministic evaluation order. Prompts and reply parsing: :mod:`agentenv.envs.alfworld_text`; textworld's lock and
  memos: :mod:`agentenv.envs.alfworld_textworld` (all re-exported here).
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

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentenv.envs.alfworld_data import (  # noqa: F401  (re-exported: the env's data names are imported from here)
    BUILTIN_PREFIX, DATA_ENV_VAR, DEMO_ARCHIVE, GAME_FILE, GAMES_SUBDIR, SAMPLE_DIR, SPLITS, TASK_TYPES, TRAJ_FILE,
    ALFWorldDataError, _how_to_get_data, _task_type_from_path, builtin_root, canonical_split, list_games,
    resolve_data_root)
from agentenv.envs.alfworld_text import (  # noqa: F401  (re-exported: the env's text names are imported from here)
    ALWAYS_ADMISSIBLE, COMPACT_MATCHING, COMPACT_SYSTEM_PROMPT_TEMPLATE, GO_TO_LINE, NEAREST_SYSTEM_PROMPT_TEMPLATE,
    SYSTEM_PROMPT_TEMPLATE, _GOAL_LINE, _format_commands, _verb_and_object, nearest_command, parse_action,
    resolve_command)
from agentenv.envs.alfworld_textworld import (  # noqa: F401  (re-exported; tests patch them on this module)
    _PLANS, _TEXTWORLD_LOCK, _install_parse_memos, _install_translation_memo)
from agentenv.envs.base import TextEnv

log = logging.getLogger(__name__)

_BANNER = "-= Welcome to TextWorld, ALFRED! =-"


def _import_alfworld():
    """``import alfworld``, tolerating an empty ``$ALFWORLD_DATA``.

    alfworld creates ``$ALFWORLD_DATA`` at import time and crashes on an empty value (``os.makedirs('')``), while
    :func:`resolve_data_root` reads empty as unset; so an empty value is dropped first, meaning the same thing to both."""
    if DATA_ENV_VAR in os.environ and not os.environ[DATA_ENV_VAR].strip():
        del os.environ[DATA_ENV_VAR]
    import alfworld

    return alfworld


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
        dev_games: int = 0,
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if invalid_action_budget is not None and invalid_action_budget < 1:
            raise ValueError(f"invalid_action_budget must be >= 1 or None (unlimited), got {invalid_action_budget}")
        self.split = canonical_split(split)
        self.data_root = resolve_data_root(data_dir)
        self.games = list_games(self.split, self.data_root, task_types, dev_games)
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
    def preflight(cls, *, splits, data_dir=None, task_types=None, dev_games=0, **_) -> list:
        """The alfworld package, and games for every split the run will train or evaluate on."""
        from agentenv.envs.spec import Check

        out = []
        for split in dict.fromkeys(s or "train" for s in splits):
            try:
                games = list_games(split, data_dir, task_types, dev_games)
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
