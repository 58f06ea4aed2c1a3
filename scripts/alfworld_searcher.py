"""A searching ALFWorld player that knows only what the agent is told: the imitable expert for SFT demos.

Lives with the scripts that use it (make_alfworld_demo_data.py, alfworld_failure_modes.py), not in the package: no
run configuration plays it.

Contract: ``ALFWorldSearcher(order=..., seed=s).act(messages, info)`` returns ``"<action>COMMAND</action>"`` with
COMMAND one of ``info["admissible_commands"]``. It reads the goal from the first observation and everything else from
the conversation so far (``messages``) and the current admissible list: no PDDL state, no walkthrough, no object
locations it has not seen. It is stateless (each call rebuilds its view from ``messages``), so one instance serves
any number of concurrent episodes, and a play is a pure function of (game, seed).

Why it exists: the stored walkthrough (:class:`~agentenv.envs.alfworld_expert.ALFWorldExpert`) walks straight to the
object, because the planner knows where it is. A model imitating those plays learns "go somewhere, then take", and
when the object is not there it invents a ``take`` (measured: ~4.4 invalid actions per episode). This searcher shows
what a policy without that knowledge must do: visit receptacles, open closed ones, take the object when it is
listed, remember where a lamp was seen, and only then deliver.

Task types: ``pick_and_place`` ("put a/some X in/on Y") and ``look_at_obj_in_light`` ("look at X under the L",
"examine the X with the L"); any other goal raises ``ValueError``. Search order (``order``):

* ``"random"`` -- unvisited receptacles in a random order drawn from (task, seed): a blind searcher. Its plays are
  competent but wasteful, which leaves a learner room to find where objects usually are.
* ``"listed"`` -- unvisited receptacles in the order the game lists them.
"""

from __future__ import annotations

import hashlib
import re
from typing import ClassVar

from agentenv.envs.alfworld import parse_action

_GOALS = (
    (re.compile(r"put (?:a|an|some) (\w+) (?:in|on) (\w+)\."), "pick_and_place"),
    (re.compile(r"look at (\w+) under the (\w+)\."), "look_at_obj_in_light"),
    (re.compile(r"examine the (\w+) with the (\w+)\."), "look_at_obj_in_light"),
)


def parse_goal(first_observation: str) -> tuple[str, str, str]:
    """(task type, object, target receptacle or lamp) from the game's opening text."""
    m = re.search(r"Your task is to: (.*)", first_observation)
    if m:
        for pattern, kind in _GOALS:
            g = pattern.fullmatch(m.group(1).strip())
            if g:
                return kind, g.group(1), g.group(2)
    raise ValueError(f"ALFWorldSearcher plays pick_and_place and look_at_obj_in_light goals only; got {m and m.group(1)!r}")


def _kind(entity: str) -> str:
    """'desklamp 1' -> 'desklamp'."""
    return entity.rsplit(" ", 1)[0]


class ALFWorldSearcher:
    """Searches receptacles for the goal's object, then delivers it; see the module docstring."""

    name = "searcher"
    env_kwargs: ClassVar[dict] = {}  # plays any ALFWorldEnv: it needs nothing the agent does not see

    def __init__(self, order: str = "random", seed: int = 0):
        if order not in ("random", "listed"):
            raise ValueError(f"order must be 'random' or 'listed', got {order!r}")
        self.order, self.seed = order, seed

    def act(self, messages: list[dict], info: dict) -> str:
        observations = [m["content"] for m in messages if m["role"] == "user"]
        # A turn without a tag (another policy's, in a shared conversation) did nothing: it stays aligned, as "".
        actions = [parse_action(m["content"]) or "" for m in messages if m["role"] == "assistant"]
        kind, obj, target = parse_goal(observations[0])
        admissible = list(info["admissible_commands"])

        # What the agent has seen: where it is, where it has been, what it holds, where lamps are.
        here, visited, held, lamp_at = None, set(), None, {}
        for action, obs in zip(actions, observations[1:]):
            if action.startswith("go to ") and obs.startswith("You arrive at"):
                here = action[len("go to "):]
                visited.add(here)
            elif action.startswith("take ") and obs.startswith("You pick up"):
                held = action[len("take "):].split(" from ")[0]
            elif action.startswith("move ") and obs.startswith("You move"):
                held = None
            if kind == "look_at_obj_in_light" and here is not None:
                for lamp in re.findall(rf"\b({re.escape(target)} \d+)", obs.split("\n\nAdmissible actions:")[0]):
                    lamp_at.setdefault(lamp, here)

        def has(cmd: str) -> bool:
            return cmd in admissible

        if held is not None and _kind(held) == obj:
            if kind == "look_at_obj_in_light":
                for cmd in admissible:
                    if cmd.startswith(f"use {target} "):
                        return self._reply(cmd)
                for lamp, where in sorted(lamp_at.items()):
                    if where != here and has(f"go to {where}"):
                        return self._reply(f"go to {where}")
            else:
                if here is not None and _kind(here) == target:
                    if has(f"open {here}"):
                        return self._reply(f"open {here}")
                    if has(f"move {held} to {here}"):
                        return self._reply(f"move {held} to {here}")
                targets = sorted(c for c in admissible if c.startswith(f"go to {target} "))
                if targets:
                    return self._reply(targets[0])
        else:
            takes = sorted(c for c in admissible if re.match(rf"take {re.escape(obj)} \d+ from ", c))
            if takes:
                return self._reply(takes[0])
            if here is not None and has(f"open {here}"):
                return self._reply(f"open {here}")
        return self._reply(self._next_receptacle(observations[0], admissible, visited, info))

    def _next_receptacle(self, intro: str, admissible: list[str], visited: set[str], info: dict) -> str:
        gotos = [c for c in admissible if c.startswith("go to ")]
        unvisited = [c for c in gotos if c[len("go to "):] not in visited]
        pool = unvisited or gotos
        if not pool:
            return "look"
        if self.order == "listed":
            return pool[0]
        # One fixed random order of the room's receptacles per (task, seed): each one's rank is a hash of the three,
        # so it does not depend on which of them the current list happens to show (stateless and reproducible).
        key = f"{info.get('task', intro)}|{self.seed}|"
        return min(pool, key=lambda c: hashlib.sha256((key + c).encode()).digest())

    @staticmethod
    def _reply(command: str) -> str:
        return f"<action>{command}</action>"
