"""The ALFWorld expert: a non-LLM :class:`~agentenv.policy.TextPolicy` that plays ``info["expert_action"]``.

Contract: ``ALFWorldExpert().act(messages, info)`` returns ``"<action>COMMAND</action>"`` for the command that the env
(:class:`~agentenv.envs.alfworld.ALFWorldEnv` built with ``expert=True``) put in ``info["expert_action"]``: the
game's stored walkthrough while the episode follows it, a PDDL-planner plan otherwise. It reads nothing else, so it
goes through the normal env interface (parsing, admissibility, turn accounting) like any other policy, and a miswired
env shows up as a clear error, never as a silently invalid action. ``env_kwargs`` names the env arguments it needs,
for whoever builds the env (``agentenv.envs.alfworld.evaluate``, the CLI).
"""

from __future__ import annotations

from typing import ClassVar


class ALFWorldExpert:
    """Plays the env's expert action. ``name`` is what trajectories record as the model."""

    name = "expert"
    env_kwargs: ClassVar[dict] = {"expert": True}  # what the env must be built with for this policy (read by evaluate() / the CLI)

    def act(self, messages: list[dict], info: dict) -> str:
        if "expert_action" not in info:
            raise ValueError(
                "the ALFWorld expert needs info['expert_action']: build the env with expert=True "
                "(e.g. gymnasium.make('agentenv/ALFWorld-v0', expert=True))"
            )
        action = info["expert_action"]
        if action is None:
            raise RuntimeError(f"the PDDL planner found no plan from the current state of {info.get('task')!r}")
        return f"<action>{action}</action>"
