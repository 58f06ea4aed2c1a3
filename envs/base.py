"""The text-environment protocol every agentenv environment follows.

An agentenv environment is a plain :class:`gymnasium.Env` whose observations and actions are unicode strings:

* ``reset(seed=None, options=None) -> (observation, info)``. ``observation`` is the first user message.
  ``info`` carries:
    - ``"role"``: ``"user"`` (the chat role of the observation),
    - ``"system"``: optional system prompt (str),
    - ``"tools"``: optional list of tool schemas (OpenAI function format) to render into the chat template,
    - ``"task"``: a string naming the task / game this episode runs (recorded in trajectories),
    - ``"task_type"``: optional category used to break metrics down (e.g. ALFWorld task type).
* ``step(action) -> (observation, reward, terminated, truncated, info)``. ``action`` is the assistant's whole message
  text. ``observation`` is the next message for the policy and ``info["role"]`` says whether it is a ``"user"`` or a
  ``"tool"`` message. Per-step counters in ``info`` (missing means 0 / False):
    - ``"tool_calls"``, ``"tool_errors"``, ``"tool_timeouts"``: well-formed tool calls executed in this step and how
      many of them failed / timed out; ``"tool_malformed"``: blocks that could not be parsed as a call (not in
      ``tool_calls``); ``"tool_calls_by_name"`` / ``"tool_errors_by_name"``: ``{tool name: count}``,
    - ``"invalid_action"``: the action could not be parsed or was not admissible (costs a turn),
    - ``"success"``: on the final step, whether the task was solved (never true merely because turns ran out),
    - ``"finish_reason"``: optional env-specific reason when the env itself ends the episode
      (e.g. ``"invalid_action_budget"``).
    - ``"episode_totals"``: optional, on the step that ends the episode: the episode's sums of the counters above
      (and ``"turns"``), so a caller that only sees the last step still gets them.
  Rewards are floats; ``terminated`` means the task ended (solved or failed), ``truncated`` that a limit cut it.
  An action that is not a ``str`` is a caller bug: :meth:`TextEnv.check_action` raises a ``TypeError`` naming the
  expected type.

Observation and action spaces are :class:`UnicodeText`, which accepts any ``str`` up to a length, so that
``gymnasium.utils.env_checker.check_env`` passes on real text.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.spaces import Text

# Printable ASCII plus a few non-ASCII letters: what `sample()` draws from. `contains` accepts any unicode text.
_SAMPLE_CHARSET = "".join(chr(c) for c in range(32, 127)) + "\néüß中文"


class UnicodeText(Text):
    """A text space that contains every ``str`` of length ``min_length..max_length`` (any unicode)."""

    def __init__(self, max_length: int = 1 << 20, *, min_length: int = 0, seed: int | np.random.Generator | None = None):
        super().__init__(max_length=max_length, min_length=min_length, charset=_SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText({self.min_length}, {self.max_length})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, UnicodeText) and (self.min_length, self.max_length) == (other.min_length, other.max_length)


class TextEnv(gym.Env):
    """Base class: sets the text spaces and the render mode. Subclasses implement ``reset`` and ``step``."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, render_mode: str | None = None, max_text_length: int = 1 << 20):
        self.observation_space = UnicodeText(max_text_length)
        self.action_space = UnicodeText(max_text_length)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, got {render_mode!r}")
        self.render_mode = render_mode
        self._last_text = ""

    def check_action(self, action: Any) -> str:
        """Return ``action`` if it is a ``str``; otherwise raise a ``TypeError`` that says what ``step`` expects."""
        if not isinstance(action, str):
            raise TypeError(
                f"{type(self).__name__}.step(action) expects the assistant's message as a str, got "
                f"{type(action).__name__} ({action!r:.60})"
            )
        return action

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self._last_text
        return None
