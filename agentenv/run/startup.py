"""What a run builds at start-up, short of the weights, checked before anything is written (``--dry-run`` too).

Contract of :func:`startup_checks(cfg, env_id, model_path)` -> a list of plan checks (``{"what", "ok", "detail"}``,
the form :func:`agentenv.run.plan.launch_plan` collects), so ``agentenv run`` stops on them before it makes a run
directory and ``--dry-run`` fails on exactly what a real run would fail on:

* ``env``: the training env is BUILT with its configured kwargs, turn limit and split (as the run builds it,
  :func:`agentenv.run.episodes.env_factory`), which loads and validates its task file, and is closed again. A
  keyword the constructor does not take names the ones it does (with a did-you-mean).
* ``tokenizer``: the model directory's tokenizer loads from local files and has a chat template (the runtime
  renders every episode through it).
* ``wandb``: ``run.wandb=true`` needs the ``wandb`` package importable (a run without it would silently log nothing
  to W&B).

Each failing check's ``detail`` is one line naming what is wrong and the fix.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import re

from agentenv.core.config import RunConfig


def startup_checks(cfg: RunConfig, env_id: str, model_path: str | None, *, env_ok: bool = True) -> list[dict]:
    checks = []
    if env_ok:
        checks.append(_env_check(cfg, env_id))
    if model_path:
        checks.append(_tokenizer_check(model_path))
    if cfg.run.wandb:
        ok = importlib.util.find_spec("wandb") is not None
        checks.append({"what": "wandb", "ok": ok, "detail": "importable" if ok else
                       "run.wandb=true but wandb is not installed: pip install wandb (then `wandb login`), or drop "
                       "--set run.wandb=true (metrics.jsonl and TensorBoard are always written)"})
    return checks


def _env_check(cfg: RunConfig, env_id: str) -> dict:
    from agentenv.run.episodes import env_factory

    try:
        make = env_factory(cfg)
    except ValueError as e:  # e.g. env.kwargs.max_turns, a split the env does not take
        return {"what": "env", "ok": False, "detail": _one_line(e)}
    problem, n = build_env(make.env_id, make.kwargs, shown=_kwargs_text(cfg))
    return {"what": "env", "ok": problem is None, "detail": problem or f"built {env_id}" + (f", {n} tasks" if n else "")}


def build_env(env_id: str, kwargs: dict, *, shown: str = "") -> tuple[str | None, int]:
    """Build ``env_id`` with ``kwargs`` (loading and validating its tasks) and close it -> (the one-line problem or
    None, its number of tasks)."""
    import gymnasium as gym

    from agentenv.envs import spec

    try:
        env = gym.make(env_id, **kwargs)
    except TypeError as e:
        return _kwarg_hint(env_id.rsplit(":", 1)[-1], e), 0
    except Exception as e:  # the user's constructor and task file: any failure is theirs to fix, named here
        return (f"building {env_id}{' with ' + shown if shown else ''} failed: {type(e).__name__}: {_one_line(e)}",
                0)
    try:
        options = spec.task_options(env)
    finally:
        env.close()
    return None, len(options or [])


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _kwargs_text(cfg: RunConfig) -> str:
    kw = dict(cfg.env.kwargs)
    return "env.kwargs " + (", ".join(f"{k}={v!r}"[:80] for k, v in kw.items()) if kw else "{}")


def _kwarg_hint(env_id: str, e: TypeError) -> str:
    """``unexpected keyword argument 'x'`` -> the parameters the constructor takes, the closest first."""
    from agentenv.envs import spec

    m = re.search(r"unexpected keyword argument '(\w+)'", str(e))
    if not m:
        return f"building {env_id} failed: TypeError: {_one_line(e)}"
    bad = m.group(1)
    try:
        params = [n for n, p in inspect.signature(spec.env_class(env_id).__init__).parameters.items()
                  if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    except (TypeError, ValueError):
        params = []
    close = difflib.get_close_matches(bad, params, n=1)
    return (f"{env_id} takes no argument {bad!r} (env.kwargs / --env-arg)"
            + (f"; did you mean {close[0]!r}?" if close else "")
            + (f" It takes: {', '.join(params)}" if params else ""))


def _tokenizer_check(model_path: str) -> dict:
    from pathlib import Path

    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
    if Path(model_path).is_dir() and not any((Path(model_path) / f).exists() for f in files):
        return {"what": "tokenizer", "ok": False, "detail": f"{model_path} holds weights but no tokenizer (none of "
                f"{', '.join(files)}); save the base model's next to them: "
                "AutoTokenizer.from_pretrained(BASE_MODEL).save_pretrained(MODEL_DIR)"}
    try:
        tok = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError or TypeError for a missing/partial tokenizer
        return {"what": "tokenizer", "ok": False, "detail": f"{model_path} has no loadable tokenizer "
                f"({type(e).__name__}: {_one_line(e)[:160]}); save one next to the weights: "
                "AutoTokenizer.from_pretrained(BASE_MODEL).save_pretrained(MODEL_DIR)"}
    if not getattr(tok, "chat_template", None):
        return {"what": "tokenizer", "ok": False, "detail": f"{model_path}: the tokenizer has no chat_template, and "
                "every episode is rendered through it; copy tokenizer_config.json (or chat_template.jinja) from the "
                "base model that the checkpoint was fine-tuned from"}
    return {"what": "tokenizer", "ok": True, "detail": f"{type(tok).__name__} with a chat template"}
