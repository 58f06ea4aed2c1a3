"""What the training harness needs to know about an environment, asked of the environment itself.

``agentenv run``, evaluation and ``agentenv list`` contain no env names: they call these functions, which read what
the env class declares (all optional; a plain gymnasium env needs none of it):

* ``preflight(cls, *, splits, **env_kwargs) -> list[Check]`` (classmethod): can the run start? (data present,
  sandbox available, package importable). Default: no checks.
* ``task_options(self) -> list[dict] | None`` (method of a built env): the reset options of every task of the split
  the env was built with (``[{"task_index": i}, ...]``, ``[{"game": i}, ...]``). Default: one per ``self.tasks`` row
  when the env has a task list, else ``None`` (episodes are then told apart by seed only).
* ``metadata["agentenv"]`` (class attribute): ``{"preset": NAME}`` names the env's preset in ``configs/``;
  without one, a tool env (:class:`~agentenv.envs.tool_env.ToolEnv`) gets the ``tool_env`` preset and any other env
  the ``text_env`` preset.
* The ONE turn limit is ``rollout.max_turns``: the runtime stops there, and an env whose constructor names a
  ``max_turns`` parameter is built with the same value (:func:`make_kwargs`), so both agree. A ``split`` parameter
  likewise receives the train or eval split.

Env ids are aliases (``python``), registered ids (``agentenv/PythonTool-v0``) or gymnasium's ``module:EnvId`` form,
which imports ``module`` (from the current directory too, as ``python -m`` would) so that it registers its envs.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass

import gymnasium as gym


ENV_ALIASES: dict[str, str] = {
    "guess": "agentenv/GuessNumber-v0",
    "python": "agentenv/PythonTool-v0",
    "python_tool": "agentenv/PythonTool-v0",
    "alfworld": "agentenv/ALFWorld-v0",
}

# Scripted (non-LLM) experts usable as `--model expert`: env id -> "module:factory" returning a TextPolicy.
EXPERTS: dict[str, str] = {
    "agentenv/ALFWorld-v0": "agentenv.envs.alfworld_expert:ALFWorldExpert",
}



@dataclass(frozen=True)
class Check:
    what: str
    ok: bool
    detail: str


def resolve(name: str) -> str:
    """Alias, registered id, or ``module:EnvId`` -> a registered gymnasium id (importing ``module`` first)."""
    env_id = ENV_ALIASES.get(name.lower(), name)
    if ":" in env_id:
        module, env_id = env_id.split(":", 1)
        import_user_module(module, f"env {name!r}")
    if env_id not in gym.registry:
        known = ", ".join(sorted(ENV_ALIASES)) + "; ids: " + ", ".join(
            sorted(k for k in gym.registry if k.startswith("agentenv/")))
        raise ValueError(f"unknown environment {name!r}. Known: {known}; or MODULE:ENV_ID for an env your module "
                         "registers with gymnasium.register")
    return env_id


def import_user_module(module: str, shown: str):
    """The user's ``module`` (importable from the current directory, as ``python -m`` would find it, or a path to a
    ``.py`` file, whose directory then joins ``sys.path`` so its own imports resolve) -> the module object; raises
    ``ValueError`` with one line: the module not found, or ``FILE:LINE`` where it failed while importing. ``shown``
    names what needs it (``env 'x:Y-v0'``)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the user's module next to where they run
    if module.endswith(".py"):
        if not os.path.isfile(module):
            raise ValueError(f"no such file {module!r} for {shown} (give a path to a .py file, or a module name "
                             "importable from the current directory)")
        folder = os.path.dirname(os.path.abspath(module))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        module = os.path.basename(module)[:-3]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
            raise ValueError(f"{_user_frame(e, module)}: {type(e).__name__}: {e} (while importing {module!r} for "
                             f"{shown})") from e
        raise ValueError(f"cannot import {module!r} for {shown}: {e} (run from the directory that holds "
                         f"{module.replace('.', '/')}.py, or give its path)") from None
    except Exception as e:  # the user's module failed while importing (e.g. a tool without a type hint)
        raise ValueError(f"{_user_frame(e, module)}: {type(e).__name__}: {e} (while importing {module!r} for "
                         f"{shown})") from e


def _user_frame(e: BaseException, module: str) -> str:
    """``FILE:LINE`` of the deepest traceback frame in the user's module (where to fix it), else the module name."""
    import traceback

    spec_ = importlib.util.find_spec(module) if module not in sys.modules else sys.modules[module].__spec__
    origin = getattr(spec_, "origin", None)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if origin and f.filename == origin]
    if not frames:
        return module
    return f"{os.path.relpath(frames[-1].filename)}:{frames[-1].lineno}"


def env_class(env_id: str) -> type:
    ep = gym.spec(env_id).entry_point
    if callable(ep):
        return ep
    module, attr = ep.split(":")
    return getattr(importlib.import_module(module), attr)


def _named_params(cls: type) -> set[str]:
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return set()
    return {n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def takes(env_id: str, param: str) -> bool:
    """Whether the env's constructor names ``param`` explicitly (``**kwargs`` does not count)."""
    return param in _named_params(env_class(env_id))


def make_kwargs(env_id: str, kwargs: dict, *, max_turns: int, split: str | None = None) -> dict:
    """The constructor kwargs for one build: the configured ones plus the run's turn limit and split."""
    if "max_turns" in kwargs:
        raise ValueError("env.kwargs.max_turns: the turn limit is rollout.max_turns (one limit for the runtime and "
                         "the env); set that instead")
    kw = dict(kwargs)
    if takes(env_id, "max_turns"):
        kw["max_turns"] = max_turns
    if split is not None:
        if not takes(env_id, "split"):
            raise ValueError(f"{env_id} has no 'split' parameter: it cannot evaluate or train on split {split!r}")
        kw["split"] = split
    return kw


def preflight(env_id: str, kwargs: dict, splits: list[str | None]) -> list[Check]:
    cls = env_class(env_id)
    fn = getattr(cls, "preflight", None)
    return list(fn(splits=splits, **kwargs)) if callable(fn) else []


def task_options(env: gym.Env) -> list[dict] | None:
    u = env.unwrapped
    fn = getattr(u, "task_options", None)
    if callable(fn):
        return fn()
    tasks = getattr(u, "tasks", None)
    if isinstance(tasks, (list, tuple)) and tasks:
        return [{"task_index": i} for i in range(len(tasks))]
    return None


def default_preset(env_id: str) -> str:
    from agentenv.envs.tool_env import ToolEnv

    cls = env_class(env_id)
    declared = (getattr(cls, "metadata", None) or {}).get("agentenv", {}).get("preset")
    if declared:
        return declared
    return "tool_env" if isinstance(cls, type) and issubclass(cls, ToolEnv) else "text_env"
