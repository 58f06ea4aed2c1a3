"""The default backend: bubblewrap namespaces + an unprivileged uid + rlimits, ~15 ms per fresh process.

What each sandboxed process gets (and how):

* New net, PID, IPC, UTS (and cgroup, where possible) namespaces: no network but a down loopback, no view of host
  processes, and ``kill -9 -1`` reaches only its own tree. ``--new-session`` (no terminal injection) and
  ``--die-with-parent``: when the host kills the outer ``bwrap`` (timeout, close, host exit or crash) the kernel
  tears down the whole PID namespace, so nothing inside can outlive the call. The same flag makes the outer
  ``bwrap`` set PR_SET_PDEATHSIG once it has cloned the sandbox, so it dies with the host process too (it fires
  when the *thread* that started it exits, hence :mod:`.process`'s long-lived spawner thread). A host killed
  within the first millisecond of a start, before that prctl, is the one window left.
* A filesystem made only of a read-only ``/usr`` (with the merged-usr ``/bin``, ``/lib``... links), a private
  ``/proc`` and minimal ``/dev``, and a private size-capped tmpfs ``/tmp`` (``Limits.disk_mb``) as the only
  writable place. No ``/etc``, ``/home``, ``/root`` or host ``/tmp``. The environment is replaced, not inherited.
* The host is root here, and root ignores RLIMIT_NPROC, so inside the namespaces ``setpriv`` drops to an
  unprivileged uid/gid with no groups, no capabilities (bounding set emptied) and no-new-privs, before the runner
  sets its rlimits (see :mod:`agentenv.sandboxes._runner`). By default every live sandbox process gets its *own*
  uid from ``UID_BASE`` upwards instead of sharing ``nobody`` (65534): RLIMIT_NPROC counts processes per uid, so
  with a shared uid one fork bomb would exhaust every other sandbox's process budget. Pass ``uid=65534`` to share.
  When the host is not root, bwrap maps the caller to uid 65534 in a user namespace instead (no setpriv needed).
* The interpreter is the system ``/usr/bin/python3`` run as ``-S -I`` (no site, no user paths, no PYTHON* env),
  because ``/root/.pyenv`` is not reachable by an unprivileged uid. Any other interpreter must be readable and
  executable by "others" all along its path, and bind its prefix via ``ro_binds``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import threading

from agentenv.sandboxes.base import RUNNER_SOURCE, Sandbox, runner_args
from agentenv.sandboxes.limits import Limits
from agentenv.sandboxes.process import PipeProc

UID_BASE, UID_SPAN = 200_000, 50_000
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


class _UidAllocator:
    """Round-robin so a just-freed uid (whose dying processes may still count for a moment) is not reused at once."""

    def __init__(self, base: int, span: int):
        self.base, self.span = base, span
        self.used: set[int] = set()
        self.next = itertools.count(os.getpid() * 97)  # other host processes start elsewhere in the range
        self.lock = threading.Lock()

    def take(self) -> int:
        with self.lock:
            for _ in range(self.span):
                uid = self.base + next(self.next) % self.span
                if uid not in self.used:
                    self.used.add(uid)
                    return uid
        raise RuntimeError(f"all {self.span} sandbox uids are in use")

    def give(self, uid: int) -> None:
        with self.lock:
            self.used.discard(uid)


_uids = _UidAllocator(UID_BASE, UID_SPAN)


def _reachable_by_others(path: str) -> bool:
    """Can an unprivileged uid execute ``path``: every directory o+x and the file o+rx."""
    real = os.path.realpath(path)
    parts = real.split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(real).st_mode
    return bool(mode & stat.S_IROTH and mode & stat.S_IXOTH)


def _mount_args() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = "/" + top
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    return args


class _BwrapProc(PipeProc):
    def __init__(self, argv, env, uid):
        self.uid = uid
        try:
            super().__init__(argv, env)
        except BaseException:
            if uid is not None:
                _uids.give(uid)
            raise

    def kill(self):
        super().kill()
        if self.uid is not None:
            _uids.give(self.uid)
            self.uid = None


class BubblewrapSandbox(Sandbox):
    name = "bubblewrap"

    def __init__(self, limits: Limits | None = None, *, python: str | None = None, uid: int | None = None,
                 ro_binds: tuple[str, ...] = (), bwrap: str | None = None):
        super().__init__(limits)
        self.bwrap = bwrap or shutil.which("bwrap")
        if not self.bwrap:
            raise RuntimeError("bubblewrap backend: `bwrap` not found; install it with `apt-get install -y bubblewrap`")
        self.as_root = os.geteuid() == 0
        self.setpriv = os.path.realpath(shutil.which("setpriv") or "/nonexistent")  # runs inside: must be in /usr
        if self.as_root and not self.setpriv.startswith("/usr/"):
            raise RuntimeError("bubblewrap backend: `setpriv` (util-linux) not found under /usr; it drops root "
                               "inside the sandbox")
        self.python = python or "/usr/bin/python3"
        if not os.path.exists(self.python):
            raise RuntimeError(f"bubblewrap backend: no interpreter at {self.python}; install python3 (the system "
                               "one) or pass python=... that an unprivileged uid can execute")
        if not _reachable_by_others(self.python):
            raise RuntimeError(f"bubblewrap backend: {self.python} is not readable/executable by an unprivileged uid "
                               "(e.g. it lives under /root); use the system /usr/bin/python3")
        for b in ro_binds:
            if not os.path.isabs(b) or not os.path.exists(b):
                raise ValueError(f"ro_binds entries must be existing absolute paths, got {b!r}")
        if uid is not None and not (isinstance(uid, int) and 0 < uid < 2**31):
            raise ValueError(f"uid must be a positive int (not root), got {uid!r}")
        self.fixed_uid = uid
        self.ro_binds = tuple(ro_binds)

    def argv(self, mode: str, limits: Limits, uid: int) -> list[str]:
        ns = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--hostname", "sandbox", "--die-with-parent", "--new-session"]
        if self.as_root:
            drop = ["--", self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                    "--bounding-set=-all", "--no-new-privs"]
        else:
            ns = ["--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL", *ns]
            drop = ["--"]
        mounts = _mount_args()
        for b in self.ro_binds:
            mounts += ["--ro-bind", b, b]
        mounts += ["--proc", "/proc", "--dev", "/dev",
                   "--perms", "1777", "--size", str(limits.disk_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]
        return [self.bwrap, *ns, *mounts, *drop,
                self.python, "-S", "-I", "-c", RUNNER_SOURCE, *runner_args(mode, limits)]

    def _start(self, mode: str, limits: Limits) -> PipeProc:
        uid = None
        if self.as_root:
            uid = self.fixed_uid if self.fixed_uid is not None else _uids.take()
        return _BwrapProc(self.argv(mode, limits, uid or 65534), dict(ENV), uid if self.fixed_uid is None else None)
