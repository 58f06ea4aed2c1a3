"""The two sides of a tool failure (used by :func:`agentenv.envs.tools.execute`).

* The model's side, :func:`exception_line`: ``Type: message`` of the exception a tool raised -- no traceback frames,
  and the host's directories (the tool's own, the working directory, home, the Python prefix) cut from the message,
  so no host paths reach the policy.
* The developer's side, :func:`report_once`: a WARNING on logger ``agentenv.envs.tools`` with the full traceback
  (or, for a bad return value, the function's file and line and the fix), once per tool and problem per process,
  so a tool that fails on every call does not flood the log.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any, Callable

log = logging.getLogger("agentenv.envs.tools")


def where_defined(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


_reported: set[tuple[str, str]] = set()  # (tool, problem) pairs already logged with their traceback: once each


def report_once(name: str, problem: str, message: str, *args: Any, exc: BaseException | None = None) -> None:
    """The developer's side of a tool failure: the full traceback / fix in the log, once per tool and problem
    (the model's side is the short error result)."""
    if (name, problem) in _reported:
        return
    _reported.add((name, problem))
    log.warning(message, *args, exc_info=(type(exc), exc, exc.__traceback__) if exc is not None else None)


def exception_line(exc: BaseException, fn: Callable) -> str:
    """``Type: message`` -- what the model sees of a tool's exception: no frames, and the host's directories (the
    tool's, the working directory, home, the Python prefix) cut from the message, so no host paths."""
    line = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    code = getattr(fn, "__code__", None)
    dirs = {os.path.dirname(code.co_filename) if code else "", os.getcwd(), os.path.expanduser("~"), sys.prefix,
            sys.base_prefix}
    for d in sorted((d for d in dirs if len(d) > 1), key=len, reverse=True):  # longest first: nested dirs
        line = line.replace(d.rstrip(os.sep) + os.sep, "")
    return line
