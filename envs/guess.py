"""GuessNumber: a small built-in multi-turn text env with a scalar terminal reward.

The env picks a secret integer in ``[low, high]``; each assistant message must contain a guess (the last integer
in the text). The env answers "higher" / "lower" as a user message. Guessing right ends the episode with reward 1;
running out of turns truncates it with reward 0 (never success). A message with no integer is an invalid action:
it is answered with a clear explanation, counted in ``info["invalid_action"]``, and costs a turn.

A guess is compared as written, however many digits it has (no ``int()`` of a 5,000-digit string, which Python
refuses): a guess longer than any number in range is simply "higher" or "lower".

It needs no model download, no sandbox and no game files, so it exercises the runtime end to end on any machine.
"""

from __future__ import annotations

import re

from agentenv.envs.base import TextEnv

_INT = re.compile(r"-?\d+")


def _bounded_int(text: str, low: int, high: int) -> int:
    """The integer ``text`` says, or ``low - 1`` / ``high + 1`` if it is too long to be in range (any length)."""
    negative, digits = text.startswith("-"), text.lstrip("-").lstrip("0") or "0"  # leading zeros count too
    if len(digits) > max(len(str(abs(low))), len(str(abs(high)))) + 1:
        return low - 1 if negative else high + 1
    return -int(digits) if negative else int(digits)


class GuessNumberEnv(TextEnv):
    def __init__(self, low: int = 1, high: int = 20, max_turns: int = 6, render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        if not low < high:
            raise ValueError(f"need low < high, got {low}, {high}")
        self.low, self.high, self.max_turns = low, high, max_turns
        self._secret = None
        self._turns = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self._secret = int(self.np_random.integers(self.low, self.high + 1))
        self._turns = 0
        obs = (f"I picked a secret integer between {self.low} and {self.high}. Guess it: answer with one number. "
               f"You have {self.max_turns} tries; after each wrong guess I say 'higher' or 'lower'.")
        self._last_text = obs
        system = "You are playing a guessing game. Reply with a single integer."
        return obs, {"role": "user", "system": system, "task": f"guess-{self.low}-{self.high}-{self._secret}",
                     "task_type": "guess"}

    def step(self, action: str):
        if self._secret is None:
            raise RuntimeError("call reset() before step()")
        self._turns += 1
        found = _INT.findall(action)
        info: dict = {"role": "user", "invalid_action": not found}
        reward, terminated = 0.0, False
        if not found:
            obs = "I could not find a number in your reply. Answer with a single integer."
        else:
            guess = _bounded_int(found[-1], self.low, self.high)
            if guess == self._secret:
                obs, reward, terminated = f"Correct! The number was {self._secret}.", 1.0, True
            else:
                obs = "higher" if guess < self._secret else "lower"
        truncated = not terminated and self._turns >= self.max_turns
        if terminated or truncated:
            info["success"] = terminated
            if truncated:
                info["finish_reason"] = "max_turns"
        self._last_text = obs
        return obs, reward, terminated, truncated, info
