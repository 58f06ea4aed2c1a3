"""agentenv environments, registered with gymnasium under the ``agentenv/`` namespace.

``gymnasium.make("agentenv/GuessNumber-v0")`` etc. Importing :mod:`agentenv` registers them; entry points are
strings, so heavy dependencies (alfworld, the sandbox) load only when that env is made. ``ENV_ALIASES`` maps the
short names the CLI accepts (``--env alfworld``) to ids. What the training harness needs to know about an env (its
preflight checks, task lists, preset, turn limit) it asks of the env itself: :mod:`agentenv.envs.spec`.
"""

from __future__ import annotations

import gymnasium as gym

from agentenv.envs.base import TextEnv, UnicodeText
from agentenv.envs.spec import ENV_ALIASES, EXPERTS
from agentenv.envs.spec import resolve as resolve_env_id


def _register(env_id: str, entry_point: str, **kwargs) -> None:
    if env_id not in gym.registry:
        gym.register(id=env_id, entry_point=entry_point, disable_env_checker=True, **kwargs)


_register("agentenv/GuessNumber-v0", "agentenv.envs.guess:GuessNumberEnv")
_register("agentenv/PythonTool-v0", "agentenv.envs.python_tool:PythonToolEnv")
_register("agentenv/ALFWorld-v0", "agentenv.envs.alfworld:ALFWorldEnv")


__all__ = ["TextEnv", "UnicodeText", "ENV_ALIASES", "EXPERTS", "resolve_env_id"]
