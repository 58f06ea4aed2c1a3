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
from agentenv.sandboxes.limits import ExecResult, Limits
from agentenv.sandboxes.pool import SandboxPool

BACKENDS = ("bubblewrap", "docker", "subprocess")

__all__ = ["BACKENDS", "ExecResult", "Limits", "Sandbox", "SandboxPool", "Session", "available_backends",
           "backend_status", "make_sandbox"]


def make_sandbox(backend: str = "bubblewrap", limits: Limits | None = None, **kwargs) -> Sandbox:
    """Build a sandbox; keyword arguments go to the backend class (e.g. ``image=`` for docker)."""
    if backend == "bubblewrap":
        from agentenv.sandboxes.bubblewrap import BubblewrapSandbox as cls
    elif backend == "docker":
        from agentenv.sandboxes.docker_backend import DockerSandbox as cls
    elif backend == "subprocess":
        from agentenv.sandboxes.unsafe import SubprocessSandbox as cls
    else:
        raise ValueError(f"unknown sandbox backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return cls(limits, **kwargs)


def backend_status() -> dict[str, str]:
    """Each backend -> "ok", or why it cannot be used here (cheap checks; the docker one asks the engine)."""
    status = {}
    try:
        make_sandbox("bubblewrap")
        status["bubblewrap"] = "ok"
    except RuntimeError as e:
        status["bubblewrap"] = str(e)
    try:
        make_sandbox("docker").close()
        status["docker"] = "ok"
    except RuntimeError as e:
        status["docker"] = str(e)
    status["subprocess"] = "ok (UNSAFE: limits only, no isolation)"
    return status


def available_backends() -> list[str]:
    """Names that :func:`make_sandbox` can build on this machine, safest first ("subprocess" is always last)."""
    return [name for name, why in backend_status().items() if why.startswith("ok")]
