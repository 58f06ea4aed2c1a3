"""Building sandboxes by backend name: :func:`make_sandbox`, :func:`backend_status`, :func:`available_backends`.

Backends load lazily (``bubblewrap`` needs the ``bwrap`` binary, ``docker`` the docker SDK and an engine).
:func:`isolation_gaps` says which isolation layers a backend would run without here; ``make_sandbox(...,
require_isolation=True)`` refuses to build one with any gap.
"""

from __future__ import annotations

from agentenv.sandboxes.base import Sandbox
from agentenv.sandboxes.limits import Limits

BACKENDS = ("bubblewrap", "docker", "subprocess")

def isolation_gaps(backend: str) -> list[str]:
    """What of namespaces + seccomp + cgroups ``backend`` would run without here ([] = every layer is active).
    Docker always has all three (its own namespaces and cgroup, our seccomp profile); bubblewrap always has its
    namespaces, and its seccomp filter and cgroups only where this machine allows them."""
    if backend == "subprocess":
        return ["namespaces", "seccomp", "cgroups (the subprocess backend isolates nothing)"]
    if backend != "bubblewrap":
        return []
    import warnings

    from agentenv.sandboxes import cgroups, seccomp_filter

    gaps = []
    if seccomp_filter.bpf() is None:
        gaps.append(f"seccomp ({seccomp_filter.UNAVAILABLE})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the refusal below says it once, in one line
        if cgroups.manager() is None:
            gaps.append(f"cgroups ({cgroups.UNAVAILABLE})")
    return gaps


def make_sandbox(backend: str = "bubblewrap", limits: Limits | None = None, *, require_isolation: bool = False,
                 **kwargs) -> Sandbox:
    """Build a sandbox; keyword arguments go to the backend class (e.g. ``image=`` for docker).
    ``require_isolation=True`` refuses (RuntimeError, one line naming what is missing) unless namespaces, the
    seccomp filter and cgroups are all active; without it a missing layer costs only a loud warning."""
    if not isinstance(require_isolation, bool):
        raise TypeError(f"require_isolation must be true or false, got {require_isolation!r}")
    if require_isolation:
        gaps = isolation_gaps(backend) if backend in BACKENDS else []
        if backend == "bubblewrap":
            gaps += [f"{k} (turned off)" for k in ("seccomp", "cgroups") if kwargs.get(k) is False]
            kwargs.update(seccomp=True, cgroups=True)
        if gaps:
            raise RuntimeError(f"require_isolation: refusing to start the {backend} sandbox without "
                               + "; ".join(gaps))
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
