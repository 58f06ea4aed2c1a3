"""Sandboxes: run model-written Python isolated, under limits, fast enough for every tool call.

    from agentenv.sandboxes import Limits, make_sandbox, SandboxPool
    sb = make_sandbox("bubblewrap", limits=Limits(timeout_s=5))
    r = sb.run("print(1 + 1)")                 # fresh process: r.stdout == "2\\n", r.ok
    with sb.session() as s:                    # persistent interpreter, cells like a notebook
        s.run("x = 2"); s.run("x * 21").stdout # "42\\n": a trailing expression echoes its repr

Backends: ``bubblewrap`` (default; :mod:`.bubblewrap`), ``docker`` (:mod:`.docker_backend`), ``subprocess``
(limits only, UNSAFE, explicit opt-in; :mod:`.unsafe`). Shared semantics: :mod:`.base`; results: :mod:`.limits`.
"""

from __future__ import annotations

from agentenv.sandboxes.base import Sandbox, Session
from agentenv.sandboxes.factory import BACKENDS, available_backends, backend_status, isolation_gaps, make_sandbox
from agentenv.sandboxes.limits import ExecResult, Limits
from agentenv.sandboxes.pool import SandboxPool

__all__ = ["BACKENDS", "ExecResult", "Limits", "Sandbox", "SandboxPool", "Session", "available_backends",
           "backend_status", "isolation_gaps", "make_sandbox"]
