"""One cgroup per sandboxed process tree: memory (all of it), process count, CPU rate, and a freezer.

rlimits bound each process on its own and miss memory that is not address space (memfd/shmem, tmpfs files, page
cache). A cgroup bounds the whole tree, counts every page charged to it, and its OOM counter says when the kernel
had to kill. Backends use it as the outer layer; the runner's rlimits stay as a second one.

Contract:

* :func:`manager` returns the process-wide :class:`CgroupManager`, or ``None`` when cgroups cannot be delegated
  here (not root, read-only cgroupfs, a v2 parent that holds processes, missing controllers); the reason is then
  in :data:`UNAVAILABLE` and logged as a loud warning once. It supports the unified hierarchy (v2: ``memory.max``,
  ``memory.swap.max = 0``, ``pids.max``, ``cpu.max``, ``cgroup.freeze``, ``cgroup.kill``, ``memory.events``) and
  the legacy one (v1: ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` (no swap), ``pids.max``,
  ``cpu.cfs_quota_us``, ``freezer.state``, ``memory.oom_control``, ``cpuacct.usage`` where mounted), detected
  from ``/proc/self/mountinfo``.
* Groups live under ``agentenv-<host pid>`` inside the host process's own cgroup for each controller, so whatever
  limits the host itself is under still apply, and two host processes never share a parent. Nothing outlives the
  host (:mod:`.reaper`): a watchdog process reaps the groups the moment the host dies, however it dies, and the
  next manager to start reaps the groups of every host that is gone (kill, thaw, remove). On v2 a group with processes
  cannot hand controllers to children, so a host alone in its (delegated) cgroup first moves itself into a leaf
  ``agentenv-host-<pid>`` beside that parent. Only the v1 path runs on the machines this was built on.
* :meth:`CgroupManager.create` makes a fresh leaf per sandboxed process tree. The tree's first process joins it
  before it execs the sandbox (:meth:`Cgroup.join_argv`), so there is no window in which it runs outside
  its limits.
* :meth:`Cgroup.destroy` kills every task in the leaf (also ones that left the sandbox's process group), thaws
  it, reads the OOM counter one last time and removes the leaf; a leaf still busy with dying tasks is removed on a
  later call or at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import logging
import os
import signal
import threading
import time
import warnings
from pathlib import Path

from agentenv.sandboxes import reaper

log = logging.getLogger(__name__)

UNAVAILABLE: str | None = None  # why cgroups are not used here (set by manager())
CPU_PERIOD_US = 100_000
EXTRA_PIDS = 3  # the outer bwrap, its PID-namespace init, and the interpreter itself before it forks anything
REST_TASKS = 3  # the same three: a session with more tasks than this between cells left something running
V1_CONTROLLERS = ("memory", "pids", "cpu", "freezer", "cpuacct")  # cpuacct where mounted: the CPU meter
V2_CONTROLLERS = ("memory", "pids", "cpu")


class CgroupUnavailableWarning(UserWarning):
    """Sandboxes run without a cgroup: memory outside the address space (shmem, tmpfs) is not bounded."""


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _own_paths(text: str | None = None) -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup (or ``text``)."""
    paths = {}
    for line in (Path("/proc/self/cgroup").read_text() if text is None else text).splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            paths[c] = path
    return paths


def _mounts(text: str | None = None) -> tuple[dict[str, tuple[str, str]], tuple[str, str] | None]:
    """v1 controller -> (mount point, mount root); and the v2 (mount point, mount root) if one is mounted; from
    /proc/self/mountinfo (or ``text``)."""
    v1, v2 = {}, None
    for line in (Path("/proc/self/mountinfo").read_text() if text is None else text).splitlines():
        left, _, right = line.partition(" - ")
        fields, (fstype, _src, superopts) = left.split(), right.split()[:3]
        root, point = fields[3], fields[4]
        if fstype == "cgroup2" and v2 is None:
            v2 = (point, root)
        elif fstype == "cgroup":
            for opt in superopts.split(","):
                if opt in V1_CONTROLLERS:
                    v1.setdefault(opt, (point, root))
    return v1, v2


def _under(mount: tuple[str, str], own: str) -> Path:
    point, root = mount
    rel = own[len(root):] if root != "/" and own.startswith(root) else own
    return Path(point) / rel.lstrip("/")


# Writes "0" (= this process) into each cgroup.procs given before "--", then execs the rest; 125 if one fails.
_JOIN = 'while [ "$1" != -- ]; do echo 0 > "$1" || exit 125; shift; done; shift; exec "$@"'


class Cgroup:
    """A leaf group (one directory per v1 controller, or one v2 directory) for one sandboxed process tree."""

    def __init__(self, manager: CgroupManager, dirs: dict[str, Path]):
        self.manager, self.dirs = manager, dirs
        self.v2 = manager.version == 2
        # Kept open and read with pread: a path-based read of a cgroup file costs ~100 us, a pread ~2 us.
        self._oom_fd = os.open(dirs["memory"] / ("memory.events" if self.v2 else "memory.oom_control"),
                               os.O_RDONLY | os.O_CLOEXEC)
        self._tasks_fd = os.open(dirs["memory" if self.v2 else "pids"] / "pids.current", os.O_RDONLY | os.O_CLOEXEC)
        self._oom_seen = self.oom_kills()
        self.frozen = False
        self._state_fd: int | None = None  # freezer.state / cgroup.events, opened at the first freeze
        self._cpu_fd: int | None = None  # cpu.stat / cpuacct.usage, opened at the first read
        self.destroyed = False

    def join_argv(self, argv: list[str]) -> list[str]:
        """``argv`` behind a tiny ``sh`` that first moves itself into every controller's leaf, then ``exec``-s it:
        the tree never runs outside its limits. (A ``preexec_fn`` would do the same but forces ``fork`` and Python
        in the child: ~10 ms per start instead of ~0.7 ms of the child's CPU.)"""
        return ["/bin/sh", "-c", _JOIN, "agentenv-cgroup-join",
                *(str(d / "cgroup.procs") for d in dict.fromkeys(self.dirs.values())), "--", *argv]

    def oom_kills(self) -> int:
        """How many tasks the kernel's OOM killer killed in this group so far."""
        for line in os.pread(self._oom_fd, 4096, 0).decode().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def tasks(self) -> int:
        """Tasks (processes and threads) in the group now."""
        return int(os.pread(self._tasks_fd, 64, 0))

    @property
    def meters_cpu(self) -> bool:  # v1 needs a cpuacct hierarchy
        return self.v2 or "cpuacct" in self.dirs

    def cpu_seconds(self) -> float:
        """CPU time every task of the group has used so far, exited ones included (v2: ``cpu.stat``)."""
        if self._cpu_fd is None:
            path = self.dirs["memory"] / "cpu.stat" if self.v2 else self.dirs["cpuacct"] / "cpuacct.usage"
            self._cpu_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        raw = os.pread(self._cpu_fd, 4096, 0)
        return int(raw.split(b"usage_usec ", 1)[1].split(b"\n", 1)[0]) / 1e6 if self.v2 else int(raw) / 1e9

    def new_oom_kill(self) -> bool:
        """True if an OOM kill happened since the last time this was asked (each kill is reported once)."""
        if self.destroyed:
            return False
        n = self.oom_kills()
        seen, self._oom_seen = self._oom_seen, n
        return n > seen

    def freeze(self, wait_s: float = 1.0) -> bool:
        """Stop every task in the group (no CPU at all) until :meth:`thaw`, and wait up to ``wait_s`` until the
        kernel reports every task frozen (v1 answers FREEZING first). Returns whether they all are."""
        if self.v2:
            _write(self.dirs["memory"] / "cgroup.freeze", "1")
            path, done = self.dirs["memory"] / "cgroup.events", b"frozen 1"
        elif "freezer" in self.dirs:
            _write(self.dirs["freezer"] / "freezer.state", "FROZEN")
            path, done = self.dirs["freezer"] / "freezer.state", b"FROZEN"
        else:
            return False
        self.frozen = True
        if self._state_fd is None:
            self._state_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        deadline = time.monotonic() + wait_s
        spins = 0
        while done not in os.pread(self._state_fd, 256, 0):
            if time.monotonic() > deadline:
                return False
            spins += 1
            if spins > 200:  # usually frozen within ~0.2 ms of spinning; a task in D state can take longer
                time.sleep(0.0005)
        return True

    def thaw(self) -> None:
        if self.frozen:
            _write(*((self.dirs["memory"] / "cgroup.freeze", "0") if self.v2 else
                     (self.dirs["freezer"] / "freezer.state", "THAWED")))
            self.frozen = False

    def pids(self) -> list[int]:
        d = self.dirs["memory"] if self.v2 else self.dirs.get("pids", self.dirs["memory"])
        try:
            return [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL every task in the group, including any that left the sandbox's process group."""
        if self.v2 and (self.dirs["memory"] / "cgroup.kill").exists():
            _write(self.dirs["memory"] / "cgroup.kill", "1")
        else:
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        try:
            self.thaw()  # v1: a frozen task does not act on SIGKILL until it is thawed
        except OSError:
            pass

    def destroy(self) -> bool:
        """Kill, read the last OOM count, remove. Returns whether an OOM kill happened since last asked."""
        if self.destroyed:
            return False
        self.kill()
        oom = self.new_oom_kill()
        self.release()
        self.manager.remove(list(dict.fromkeys(self.dirs.values())))
        return oom

    def release(self) -> None:
        """Stop using the group without touching its tasks (a group someone else owns, e.g. a container's)."""
        if self.destroyed:
            return
        self.destroyed = True
        for fd in (self._oom_fd, self._tasks_fd, self._state_fd, self._cpu_fd):
            if fd is not None:
                os.close(fd)


class CgroupManager:
    """The parent group(s) of this host process and the leaves under them; see the module docstring."""

    def __init__(self, version: int, parents: dict[str, Path]):
        self.version, self.parents = version, parents
        self._count = itertools.count()
        self._lock = threading.Lock()
        self._pending: list[Path] = []  # leaves whose dying tasks had not all left yet
        self._retry_timer: threading.Timer | None = None

    def create(self, memory_bytes: int, max_pids: int, cpus: float) -> Cgroup:
        self._retry_pending()
        name = f"sb-{next(self._count)}"
        dirs = {c: p / name for c, p in self.parents.items()}
        made = []
        try:
            for d in dict.fromkeys(dirs.values()):
                d.mkdir()
                made.append(d)
            quota = max(1000, int(cpus * CPU_PERIOD_US))
            if self.version == 2:
                d = dirs["memory"]
                _write(d / "memory.max", str(memory_bytes))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                _write(d / "pids.max", str(max_pids))
                _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                m = dirs["memory"]
                _write(m / "memory.limit_in_bytes", str(memory_bytes))
                if (m / "memory.memsw.limit_in_bytes").exists():  # memory + swap = memory: no swap at all
                    _write(m / "memory.memsw.limit_in_bytes", str(memory_bytes))
                _write(dirs["pids"] / "pids.max", str(max_pids))
                _write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(dirs["cpu"] / "cpu.cfs_quota_us", str(quota))
            return Cgroup(self, dirs)
        except BaseException:
            self.remove(made)
            raise

    def remove(self, dirs: list[Path]) -> None:
        with self._lock:
            for d in dirs:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    if e.errno != errno.EBUSY:
                        raise
                    self._pending.append(d)
            if self._pending and self._retry_timer is None:
                self._schedule_retry(0.05)

    def _schedule_retry(self, delay: float) -> None:
        """Killed tasks leave their group within milliseconds: remove it then, even if no sandbox starts again
        (a long idle trainer, or a pool that was closed), backing off up to ~5 s, then leaving it to exit."""
        def retry():
            self._retry_pending()  # remove() sees this timer still set and schedules no other
            with self._lock:
                self._retry_timer = None
                if self._pending and delay < 5:
                    self._schedule_retry(delay * 2)

        self._retry_timer = threading.Timer(delay, retry)
        self._retry_timer.daemon = True
        self._retry_timer.start()

    def _retry_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            self.remove(pending)

    def cleanup(self, wait_s: float = 1.0) -> None:
        """At exit: kill what is left in every leaf, then remove the leaves and the parents (a leaf whose tasks
        are still dying after ``wait_s`` stays behind, empty soon, for the next start or the admin)."""
        reaper.reap(list(dict.fromkeys(self.parents.values())), wait_s)


def of_process(pid: int) -> Cgroup | None:
    """A view of the cgroup that holds ``pid`` (e.g. a container's init), to freeze and thaw; its owner (the
    container engine) removes it: use :meth:`Cgroup.release`, never :meth:`Cgroup.destroy`. None if not found."""
    try:
        own = _own_paths(Path(f"/proc/{pid}/cgroup").read_text())
        v1, v2 = _mounts()
        if all(c in v1 and c in own for c in ("memory", "pids", "freezer")):
            used = [c for c in ("memory", "pids", "freezer", "cpuacct") if c in v1 and c in own]
            return Cgroup(CgroupManager(1, {}), {c: _under(v1[c], own[c]) for c in used})
        if v2 is not None and "" in own:
            return Cgroup(CgroupManager(2, {}), {"memory": _under(v2, own[""])})
    except (OSError, ValueError):
        pass
    return None


def _make_parent(path: Path) -> Path:
    _remove_stale(path.parent)
    path.mkdir(exist_ok=True)
    return path


def _remove_stale(base: Path) -> None:
    """Reap the groups of host processes that died without cleaning up (killed, and their watchdog too): kill and
    thaw what is left in them (a frozen task ignores SIGKILL until thawed), then remove them."""
    for parent in base.glob("agentenv-*"):
        pid = parent.name.removeprefix("agentenv-").removeprefix("host-")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            reaper.reap([parent], wait_s=0.5)


def _enable_v2_controllers(base: Path) -> None:
    """Enable memory/pids/cpu for ``base``'s children. v2 allows that only in a group without processes of its own
    ("no internal processes"): if ``base`` holds this host process (a delegated scope), the host moves itself into a
    leaf ``agentenv-host-<pid>`` first; if other processes are there too, it moves back and gives up."""
    line = " ".join(f"+{c}" for c in V2_CONTROLLERS)
    try:
        _write(base / "cgroup.subtree_control", line)
        return
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
    host = base / f"agentenv-host-{os.getpid()}"
    host.mkdir(exist_ok=True)
    _write(host / "cgroup.procs", "0")
    try:
        _write(base / "cgroup.subtree_control", line)
    except OSError:
        _write(base / "cgroup.procs", "0")
        host.rmdir()
        raise


def _detect() -> CgroupManager:
    own = _own_paths()
    v1, v2 = _mounts()
    name = f"agentenv-{os.getpid()}"
    if all(c in v1 for c in ("memory", "pids", "cpu")):
        parents = {c: _make_parent(_under(v1[c], own.get(c, "/")) / name) for c in V1_CONTROLLERS if c in v1}
        return CgroupManager(1, parents)
    if v2 is None:
        raise OSError("no cgroup v1 memory/pids/cpu controllers and no cgroup2 mount")
    base = _under(v2, own.get("", "/"))
    missing = set(V2_CONTROLLERS) - set((base / "cgroup.controllers").read_text().split())
    if missing:
        raise OSError(f"cgroup v2 at {base} lacks the {sorted(missing)} controller(s)")
    parent = _make_parent(base / name)
    try:
        _enable_v2_controllers(base)
        _write(parent / "cgroup.subtree_control", " ".join(f"+{c}" for c in V2_CONTROLLERS))
    except OSError as e:
        parent.rmdir()
        raise OSError(f"cannot enable controllers below {base} ({e}); start the host in a delegated cgroup of its "
                      "own, e.g. `systemd-run --user --scope -p Delegate=yes ...`") from e
    return CgroupManager(2, {"memory": parent})


def _start_watchdog(m: CgroupManager):
    try:
        return reaper.start_watchdog(list(dict.fromkeys(m.parents.values())))
    except OSError as e:  # the next host's start still reaps what this one leaves
        log.warning("agentenv sandboxes: no cgroup watchdog (%s); a SIGKILLed host's frozen sandboxes are reaped "
                    "only by the next start", e)
        return None


_manager: CgroupManager | None = None
_manager_pid = 0
_detect_lock = threading.Lock()


def manager() -> CgroupManager | None:
    """The process-wide manager (created on first use; a forked child gets its own), or None with a warning."""
    global _manager, _manager_pid, UNAVAILABLE
    with _detect_lock:
        if _manager_pid == os.getpid():
            return _manager
        _manager_pid = os.getpid()
        _manager, UNAVAILABLE = None, None
        try:
            _manager = _detect()
            atexit.register(_manager.cleanup)
            _manager.watchdog = _start_watchdog(_manager)
        except (OSError, ValueError) as e:
            UNAVAILABLE = f"{type(e).__name__}: {e}"
            msg = ("agentenv sandboxes run WITHOUT cgroups (only per-process rlimits): memory held in shared "
                   "memory or tmpfs, and the tree's total memory, are not bounded here. Cause: " + UNAVAILABLE)
            warnings.warn(msg, CgroupUnavailableWarning, stacklevel=3)
            log.warning(msg)
        return _manager
