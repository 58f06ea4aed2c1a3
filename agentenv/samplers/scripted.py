"""A scripted policy: the user's own Python function as a policy (``agentenv rollout --model MODULE:CALLABLE``).

Contract:

* :func:`is_scripted(model)` tells a ``--model`` value of the form ``MODULE:CALLABLE`` (``CALLABLE`` a Python name,
  ``MODULE`` a module name or a path to a ``.py`` file) from the other model specs (``tiny:64x2``, a checkpoint
  directory, a hub id or alias).
* :func:`load_scripted(spec)` imports ``MODULE`` as ``--env MODULE:ENV_ID`` does (importable from the current
  directory, or a path to a ``.py`` file: :func:`agentenv.envs.spec.import_user_module`) and returns a
  :class:`ScriptedPolicy` over its ``CALLABLE``. A module that is not found or fails while importing, a missing
  attribute (with the module's functions listed) or one that is not callable raises :class:`ScriptError`: one line
  naming the problem and the fix.
* :class:`ScriptedPolicy` is a :class:`agentenv.core.policy.TextPolicy`, played by the runtime like the ALFWorld
  expert or a served model: ``act(messages, info)`` calls ``fn(chat)`` with the conversation so far in the OpenAI
  chat format (:func:`agentenv.samplers.endpoint.to_openai_messages`: the env's system prompt first, the
  ``user`` question, assistant turns with structured ``tool_calls``, one ``tool`` message per call) and turns its
  reply into the env's action as a served model's reply is turned (:func:`agentenv.samplers.endpoint.reply_to_action`:
  the content, then one Hermes ``<tool_call>`` block per call). The reply is the next assistant message: a ``str``
  (its text, as written), or a dict with ``content`` (str or None) and/or ``tool_calls`` (``[{"type": "function",
  "function": {"name": ..., "arguments": {...} or its JSON text}}]``). Anything else raises :class:`ScriptError`
  naming the callable and what it returned.
* :meth:`ScriptedPolicy.check` is the pre-flight: one call on an env's first prompt, so that a bad reply is an error
  before any output is written.
"""

from __future__ import annotations

import json
import re

from agentenv.samplers.endpoint import reply_to_action, to_openai_messages

_SPEC = re.compile(r"^(?P<module>[^:]+):(?P<attr>[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*)$")
FIX = ('return the next assistant message: a string, or {"content": ..., "tool_calls": [{"type": "function", '
       '"function": {"name": ..., "arguments": {...}}}]}')


class ScriptError(ValueError):
    """A scripted policy cannot be loaded or answered something that is not a message; the message is one line."""


def is_scripted(model: str) -> bool:
    """Whether ``--model`` names a Python callable (``MODULE:CALLABLE``) rather than a model."""
    m = _SPEC.match(model)
    if m is None:
        return False
    module = m["module"]
    return module.endswith(".py") or all(p.isidentifier() for p in module.split("."))


def load_scripted(spec: str) -> "ScriptedPolicy":
    """``MODULE:CALLABLE`` -> its :class:`ScriptedPolicy` (see the module docstring); raises :class:`ScriptError`."""
    from agentenv.envs.spec import import_user_module

    m = _SPEC.match(spec)
    if m is None:
        raise ScriptError(f"--model {spec!r} is not MODULE:CALLABLE (e.g. solver:solve, or path/to/solver.py:solve)")
    try:
        obj = import_user_module(m["module"], f"--model {spec}")
    except ValueError as e:
        raise ScriptError(str(e)) from e
    where = m["module"]
    for part in m["attr"].split("."):
        if not hasattr(obj, part):
            names = sorted(k for k, v in vars(obj).items() if callable(v) and not k.startswith("_")
                           and getattr(v, "__module__", None) == getattr(obj, "__name__", None))
            raise ScriptError(f"--model {spec}: {where} has no attribute {part!r}; define it there, or name one of "
                              f"its functions: {', '.join(names) or 'none'}")
        obj, where = getattr(obj, part), f"{where}.{part}"
    if not callable(obj):
        raise ScriptError(f"--model {spec}: {where} is {_a(type(obj).__name__)}, not callable; name a function from "
                          "the message list (OpenAI chat format) to the next assistant message")
    return ScriptedPolicy(obj, spec)


def _as_message(reply, name: str) -> dict:
    """The callable's reply as an assistant message dict; raises :class:`ScriptError` when it is not one."""
    if isinstance(reply, str):
        return {"role": "assistant", "content": reply}
    shown = f"{_a(type(reply).__name__)} {json.dumps(reply, default=repr)[:120]}"
    if not isinstance(reply, dict):
        raise ScriptError(f"--model {name} returned {shown}; {FIX}")
    if reply.get("role", "assistant") != "assistant":
        raise ScriptError(f"--model {name} returned a message with role {reply['role']!r}; {FIX}")
    content, calls = reply.get("content"), reply.get("tool_calls")
    if content is not None and not isinstance(content, str):
        raise ScriptError(f"--model {name} returned content of type {type(content).__name__}; {FIX}")
    if calls is not None and not isinstance(calls, list):
        raise ScriptError(f"--model {name} returned tool_calls of type {type(calls).__name__} (a list is needed); {FIX}")
    for k, c in enumerate(calls or []):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ScriptError(f"--model {name} returned tool_calls[{k}] without function.name: "
                              f"{json.dumps(c, default=repr)[:120]}; {FIX}")
        if not isinstance(fn.get("arguments", {}), (dict, str)):
            raise ScriptError(f"--model {name} returned tool_calls[{k}].function.arguments of type "
                              f"{type(fn['arguments']).__name__} (a JSON object or its text is needed)")
    if content is None and not calls:
        raise ScriptError(f"--model {name} returned a message with neither content nor tool_calls; {FIX}")
    return reply


class ScriptedPolicy:
    """A user's function ``messages -> next assistant message`` as a :class:`~agentenv.core.policy.TextPolicy`."""

    backend = "text"

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name

    def act(self, messages: list[dict], info: dict) -> str:
        return reply_to_action(_as_message(self.fn(to_openai_messages(messages)), self.name))

    def check(self, messages: list[dict]) -> None:
        """One call on an env's first prompt (see the module docstring); raises :class:`ScriptError` for a reply
        that is not a message, or for the callable raising (with the file and line where it did)."""
        try:
            reply = self.fn(to_openai_messages(messages))
        except Exception as e:  # noqa: BLE001 -- the user's code: one line with where it failed
            raise ScriptError(f"--model {self.name} raised {type(e).__name__}: {e} {_where(e)}on the env's first "
                              "prompt") from e
        _as_message(reply, self.name)


def _a(noun: str) -> str:
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun


def _where(e: BaseException) -> str:
    import os
    import traceback

    frames = traceback.extract_tb(e.__traceback__)
    return f"at {os.path.relpath(frames[-1].filename)}:{frames[-1].lineno} " if len(frames) > 1 else ""
