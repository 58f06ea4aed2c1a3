"""The ``subprocess`` backend: resource limits only, NO isolation. Explicit opt-in; it warns on every construction.

The code runs as the host user with the host's filesystem and network; only its environment is cleared and its
working directory is a private temp dir. Enforced: wall timeout (SIGKILL to the process group; a child that calls
``setsid()`` escapes it), CPU, address space, file size. RLIMIT_NPROC does not bind root, and ``disk_mb`` is not
enforced at all. Use it for trusted code, debugging, or where bubblewrap and Docker are unavailable.
"""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import warnings
import weakref

from agentenv.sandboxes.base import RUNNER_SOURCE, Sandbox, runner_args
from agentenv.sandboxes.limits import Limits
from agentenv.sandboxes.process import PipeProc

log = logging.getLogger(__name__)


class UnsafeSandboxWarning(UserWarning):
    """Code is about to run with no isolation (the explicit ``subprocess`` backend)."""


class SubprocessSandbox(Sandbox):
    name = "subprocess"
    unsafe = True

    def __init__(self, limits: Limits | None = None, *, python: str | None = None):
        super().__init__(limits)
        msg = ("UNSAFE sandbox backend 'subprocess': code runs as this user with full filesystem and network "
               "access; only resource limits apply. Use 'bubblewrap' or 'docker' for untrusted code.")
        warnings.warn(msg, UnsafeSandboxWarning, stacklevel=3)
        log.warning(msg)
        self.python = python or sys.executable
        self.workdir = tempfile.mkdtemp(prefix="agentenv-unsafe-")
        self._rmdir = weakref.finalize(self, shutil.rmtree, self.workdir, ignore_errors=True)  # also at exit

    def _start(self, mode: str, limits: Limits) -> PipeProc:
        env = {"PATH": "/usr/bin:/bin", "HOME": self.workdir, "TMPDIR": self.workdir, "LANG": "C.UTF-8"}
        return PipeProc([self.python, "-S", "-I", "-c", RUNNER_SOURCE, *runner_args(mode, limits)], env,
                        cwd=self.workdir)

    def close(self) -> None:
        super().close()
        self._rmdir()
