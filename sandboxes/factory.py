"""Building sandboxes by backend name: :func:`make_sandbox`, :func:`backend_status`, :func:`available_backends`.

Backends load lazily (``bubblewrap`` needs the ``bwrap`` binary, ``docker`` the docker SDK and an engine).
"""

from __future__ import annotations

from agentenv.sandboxes.base import Sandbox
from agentenv.sandboxes.limits import Limits

BACKENDS = ("bubblewrap", "docker", "subprocess")

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
