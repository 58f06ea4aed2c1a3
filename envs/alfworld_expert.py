"""The ALFWorld expert: a non-LLM :class:`~agentenv.core.policy.TextPolicy` that plays ``info["expert_action"]``.

Contract: ``ALFWorldExpert().act(messages, info)`` returns ``"<action>COMMAND</action>"`` for the command that the env
(:class:`~agentenv.envs.alfworld.ALFWorldEnv` built with ``expert=True``) put in ``info["expert_action"]``: the
game's stored walkthrough while the episode follows it, a PDDL-planner plan otherwise. It reads nothing but ``info``, so it
goes through the normal env interface (parsing, admissibility, turn accounting) like any other policy, and a miswired
env shows up as a clear error, never as a silently invalid action. ``env_kwargs`` names the env arguments it needs,
for whoever builds the env (:meth:`agentenv.run.episodes.EpisodeSet.for_policy`, the CLI).

``ALFWorldExpert(noise=p, seed=s)`` is the *noisy* expert used for SFT demonstrations: at each turn, with probability
``p`` it plays a uniformly drawn admissible command other than the expert's (``help`` excluded: it changes nothing
and teaches nothing), and the env replans from wherever that leaves the game. Its demos therefore show detours and
recoveries, and a model imitating them is a competent but imperfect player -- room that RL can close. The draws come
from one ``random.Random(seed)``: reproducible when episodes run one at a time.
"""

from __future__ import annotations

import random
import threading
from typing import ClassVar


class ALFWorldExpert:
    """Plays the env's expert action (or, with probability ``noise``, a random admissible one)."""

    name = "expert"
    env_kwargs: ClassVar[dict] = {"expert": True}  # the env this policy needs (EpisodeSet.for_policy)

    def __init__(self, noise: float = 0.0, seed: int = 0):
        if not 0.0 <= noise < 1.0:
            raise ValueError(f"noise must be in [0, 1), got {noise}")
        self.noise = noise
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # the runtime may call act() from several threads

    def act(self, messages: list[dict], info: dict) -> str:
        if "expert_action" not in info:
            raise ValueError(
                "the ALFWorld expert needs info['expert_action']: build the env with expert=True "
                "(e.g. gymnasium.make('agentenv/ALFWorld-v0', expert=True))"
            )
        action = info["expert_action"]
        if self.noise:
            others = [c for c in info.get("admissible_commands", ()) if c not in (action, "help")]
            with self._lock:
                if others and self._rng.random() < self.noise:
                    return self._reply(self._rng.choice(others), info)
        if action is None:
            raise RuntimeError(f"the PDDL planner found no plan from the current state of {info.get('task')!r}")
        return self._reply(action, info)

    @staticmethod
    def _reply(command: str, info: dict) -> str:
        return f"<action>{command}</action>"
