"""What the ``agentenv`` command prints around the work: one line for the user's mistakes, and no progress bars in
logs.

* :func:`user_error(e)` -> the one line to print as ``error: LINE`` (exit 2) when ``e`` is the user's to fix, else
  ``None`` (a bug of ours: it keeps its traceback; ``-v`` shows the traceback in both cases). The user's: a config or
  launch problem (:class:`~agentenv.core.config.ConfigError`, :class:`~agentenv.run.plan.LaunchError`), a model that
  cannot be loaded (:class:`~agentenv.samplers.models.ModelNotAvailable`), a bad demo
  (:class:`~agentenv.run.env_demos.DemoError`), a bad tool declaration
  (:class:`~agentenv.envs.tools.ToolDefinitionError`), a missing file, and a ``ValueError`` from resolving or building
  the user's env or reading their data (its message names the file, line or field).
* :func:`quiet_progress_unless_tty()`: when stderr is not a terminal (a redirected log, CI), no library draws a
  progress bar: tqdm (``TQDM_DISABLE``, read when tqdm is first imported), the Hugging Face hub and transformers
  ("Loading weights", "Writing model shards"). A bar redrawn into a file turns into one huge line that hides the
  greppable ``[update N]`` lines.
"""

from __future__ import annotations

import os
import sys


def user_error(e: BaseException) -> str | None:
    from agentenv.core.config import ConfigError
    from agentenv.envs.tools import ToolDefinitionError
    from agentenv.run.env_demos import DemoError
    from agentenv.run.plan import LaunchError
    from agentenv.samplers.models import ModelNotAvailable

    if isinstance(e, (ConfigError, LaunchError, ModelNotAvailable, DemoError, ToolDefinitionError, FileNotFoundError,
                      ValueError)):
        return str(e).strip() or type(e).__name__
    return None


def quiet_progress_unless_tty(stream=None) -> bool:
    """Turn progress bars off when ``stream`` (default stderr) is not a terminal; returns whether it did."""
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        return False
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    return True
