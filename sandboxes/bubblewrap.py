"""The default backend: bubblewrap namespaces + an unprivileged uid + rlimits, ~15 ms per fresh process.

What each sandboxed process gets (and how):

* New net, PID, IPC, UTS (and cgroup, where possible) namespaces: no network but a down loopback, no view of host
  processes, and ``kill -9 -1`` reaches only its own tree. ``--new-session`` (no terminal injection) and
  ``--die-with-parent``: when the host kills the outer ``bwrap`` (timeout, close, host exit or crash) the kernel
  tears down the whole PID namespace, so nothing inside can outlive the call. The same flag makes the outer
  ``bwrap`` set PR_SET_PDEATHSIG once it has cloned the sandbox, so it dies with the host process too (it fires
  when the *thread* that started it exits, hence :mod:`.process`'s long-lived spawner thread). A host killed
  within the first millisecond of a start, before that prctl, is the one window left.
* A filesystem made only of read-only ``/usr/bin``, ``/usr/lib``, ``/usr/lib64`` and ``/usr/share/zoneinfo``
  (:data:`USR_DIRS`, with the merged-usr ``/bin``, ``/lib``... links; not ``/usr/local``), a private
  ``/proc`` and minimal ``/dev``, and a private size-capped tmpfs ``/tmp`` (``Limits.disk_mb``) as the only
  writable place. No ``/etc``, ``/home``, ``/root`` or host ``/tmp``. The environment is replaced, not inherited.
* The host is root here, and root ignores RLIMIT_NPROC, so inside the namespaces ``setpriv`` drops to an
  unprivileged uid/gid with no groups, no capabilities (bounding set emptied) and no-new-privs, before the runner
  sets its rlimits (see :mod:`agentenv.sandboxes._runner`). Every sandbox process gets its *own* uid, and a uid is
  never handed out twice by one host process (a counter from a random start in a 2**30-wide range, so two host
  processes overlap with negligible probability): RLIMIT_NPROC counts processes per uid, so with a shared uid one
  fork bomb would exhaust every other sandbox's budget, and the kernel keyring is per uid and outlives the
  sandbox. Pass ``uid=65534`` to share one uid. When the host is not root, bwrap maps the caller to uid 65534 in
  a user namespace instead (no setpriv needed) with ``--disable-userns`` (no nested user namespaces).
* A seccomp filter (:mod:`.seccomp_filter`, ``--seccomp FD``) denies new namespaces (so no nested user namespace
  and no uncapped tmpfs mounted inside one), mounts, the kernel keyring, ptrace, bpf, perf, userfaultfd,
  io_uring, module loading, TIOCSTI and the rest of Docker's default denials.
* A cgroup per sandboxed process tree (:mod:`.cgroups`): ``Limits.memory_mb`` also caps the tree's *total*
  memory, counting shared memory (memfd), tmpfs files and page cache, with no swap; ``pids.max`` caps its tasks
  (``max_processes`` plus bwrap's own); its CPU rate is capped at ``cpus`` cores; ``memory_exceeded`` comes from
  the group's OOM counter. A session call ends only once the interpreter is provably idle at the runner's read,
  and whatever a cell left able to run is frozen until the next cell (:mod:`.boundary`). Where cgroups or the seccomp filter are unavailable the sandbox still runs, after a loud
  warning (``cgroups=False`` / ``seccomp=False`` turn them off; ``True`` makes their absence an error).
* ``ready`` (default 2) fresh sandboxes for the default limits are kept started ahead of need (:mod:`.ready`):
  a ``run`` takes one that has its namespaces, cgroup and interpreter up, and a replacement starts in the
  background, so a call pays the start only when calls come faster than starts.
* The interpreter is the system ``/usr/bin/python3`` run as ``-S -I`` (no site, no user paths, no PYTHON* env),
  because ``/root/.pyenv`` is not reachable by an unprivileged uid. Any other interpreter must be readable and
  executable by "others" all along its path, and bind its prefix via ``ro_binds``.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import shutil
import stat
import threading
import warnings

from agentenv.sandboxes import cgroups as cgroups_mod
from agentenv.sandboxes import seccomp_filter
from agentenv.sandboxes.base import RUNNER_SOURCE, Sandbox, runner_args
from agentenv.sandboxes.limits import Limits
from agentenv.sandboxes.process import PipeProc

log = logging.getLogger(__name__)
UID_BASE, UID_SPAN = 1 << 20, 1 << 30  # uids 1,048,576 .. 2**30 + 2**20: clear of system and login users
ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


class SeccompUnavailableWarning(UserWarning):
    """Sandboxes run without the seccomp filter (libseccomp's Python binding is missing)."""


class _UidAllocator:
    """Hands out each uid once per host process: a key or a dying process of an old sandbox never meets a new one."""

    def __init__(self, base: int, span: int):
        self.base, self.span = base, span
        self.next = itertools.count(secrets.randbelow(span))  # other host processes start elsewhere in the range
        self.lock = threading.Lock()

    def take(self) -> int:
        with self.lock:
            return self.base + next(self.next) % self.span


def _reachable_by_others(path: str) -> bool:
    """Can an unprivileged uid execute ``path``: every directory o+x and the file o+rx."""
    real = os.path.realpath(path)
    parts = real.split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(real).st_mode
    return bool(mode & stat.S_IROTH and mode & stat.S_IXOTH)


# What the system interpreter and tool code need of /usr; not /usr/local (its etc/ holds host configuration such
# as package-registry credentials), /usr/etc, /usr/src or /usr/include.
USR_DIRS = ("/usr/bin", "/usr/lib", "/usr/lib64", "/usr/share/zoneinfo")


def _mount_args() -> list[str]:
    args = ["--perms", "0755", "--dir", "/usr", "--perms", "0755", "--dir", "/usr/share"]  # else 0700: root's only
    for d in USR_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            args += ["--ro-bind", d, d]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        p = "/" + top
        if os.path.islink(p):
            args += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            args += ["--ro-bind", p, p]
    return args


_uids = _UidAllocator(UID_BASE, UID_SPAN)


def _feature(wanted: bool | None, available: bool, what: str, why: str | None, category) -> bool:
    """Use a hardening layer if available; None = warn loudly when it is not, True = refuse to run without it."""
    if wanted is False or available:
        return bool(wanted is not False and available)
    msg = f"bubblewrap backend: running WITHOUT {what} ({why})"
    if wanted:
        raise RuntimeError(msg)
    warnings.warn(msg, category, stacklevel=4)
    log.warning(msg)
    return False


class BubblewrapSandbox(Sandbox):
    name = "bubblewrap"

    def __init__(self, limits: Limits | None = None, *, python: str | None = None, uid: int | None = None,
                 ro_binds: tuple[str, ...] = (), bwrap: str | None = None, cpus: float = 1.0,
                 cgroups: bool | None = None, seccomp: bool | None = None, ready: int = 2):
        super().__init__(limits)
        if isinstance(ready, bool) or not isinstance(ready, int) or ready < 0:
            raise ValueError(f"ready must be a count >= 0 of fresh sandboxes kept started (0: none), got {ready!r}")
        self.ready_depth = ready
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0:
            raise ValueError(f"cpus must be a positive number of cores, got {cpus!r}")
        self.cpus = float(cpus)
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
        real = os.path.realpath(self.python)
        if not any(real.startswith(d + "/") for d in (*USR_DIRS, *map(os.path.realpath, ro_binds))):
            raise ValueError(f"bubblewrap backend: {self.python} is outside what the sandbox mounts "
                             f"({', '.join(USR_DIRS)}); bind its prefix with ro_binds=(...)")
        if uid is not None and not (isinstance(uid, int) and 0 < uid < 2**31):
            raise ValueError(f"uid must be a positive int (not root), got {uid!r}")
        self.fixed_uid = uid
        self.ro_binds = tuple(ro_binds)
        self.cgroups = cgroups_mod.manager() if cgroups is not False else None
        if not _feature(cgroups, self.cgroups is not None, "cgroups (only per-process rlimits bound memory)",
                        cgroups_mod.UNAVAILABLE, cgroups_mod.CgroupUnavailableWarning):
            self.cgroups = None
        self.seccomp = seccomp_filter.bpf() if seccomp is not False else None
        if not _feature(seccomp, self.seccomp is not None, "a seccomp filter", seccomp_filter.UNAVAILABLE,
                        SeccompUnavailableWarning):
            self.seccomp = None

    def argv(self, mode: str, limits: Limits, uid: int, seccomp_fd: int | None = None) -> list[str]:
        ns = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--hostname", "sandbox", "--die-with-parent", "--new-session"]
        if self.as_root:
            drop = ["--", self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                    "--bounding-set=-all", "--no-new-privs"]
        else:
            ns = ["--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns", "--cap-drop", "ALL", *ns]
            drop = ["--"]
        mounts = _mount_args()
        for b in self.ro_binds:
            mounts += ["--ro-bind", b, b]
        mounts += ["--proc", "/proc", "--dev", "/dev",
                   "--perms", "1777", "--size", str(limits.disk_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]
        if seccomp_fd is not None:
            ns += ["--seccomp", str(seccomp_fd)]
        return [self.bwrap, *ns, *mounts, *drop,
                self.python, "-S", "-I", "-c", RUNNER_SOURCE, *runner_args(mode, limits)]

    def _start(self, mode: str, limits: Limits) -> PipeProc:
        uid = (self.fixed_uid or _uids.take()) if self.as_root else 65534
        group = fd = None
        try:
            if self.cgroups is not None:
                group = self.cgroups.create(limits.memory_mb << 20, limits.max_processes + cgroups_mod.EXTRA_PIDS,
                                            self.cpus)
            if self.seccomp is not None:
                fd = seccomp_filter.program_fd(self.seccomp)
            return PipeProc(self.argv(mode, limits, uid, fd), dict(ENV), cgroup=group,
                            pass_fds=(fd,) if fd is not None else (), rest_tasks=cgroups_mod.REST_TASKS)
        except BaseException:
            if group is not None:
                group.destroy()
            raise
        finally:
            if fd is not None:
                os.close(fd)
