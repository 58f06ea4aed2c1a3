"""The cell boundary of a session: proving, from outside, that its interpreter is back at the runner's read.

The end-of-cell marker on stdout only says that *something* in the sandbox wrote it; the cell's own code can
write the same bytes (everything in the interpreter, the nonce included, is reachable from the cell). So a
session call ends only when the host has seen, in ``/proc`` of the sandbox's interpreter, a state no code of the
cell can fake while still running:

* **Idle without a freeze** (:meth:`IdleProbe.idle`, ~20 us): the cgroup holds exactly the three tasks of a
  resting sandbox (outer bwrap, its init, the interpreter; so no thread and no child), the interpreter is
  asleep in a *blocking* ``read`` of the host's cell pipe, it catches no signal at all (the runner resets
  SIGINT to its default, so any handler is the cell's), and its context-switch counters did not move between
  the first and the last look -- it slept in that read for the whole check. Nothing inside can then wake it: only
  the host's next cell, or a signal whose default action stops or kills it (no CPU either way).
* **Otherwise frozen** (:meth:`IdleProbe.frozen_at_read`): the whole cgroup is frozen, and the frozen interpreter's
  main thread must be in that same blocking read. Threads, children and pending timers stay frozen until the
  next cell thaws them, so they get CPU only inside a call, under its limits.

If neither holds (the marker was forged and the cell still runs, or a signal handler was running), the host
thaws the tree and looks again until the call's deadline, then treats the call as timed out. A cell that itself
blocks in a read of the cell pipe passes the check: it has then taken over its own interpreter's protocol,
which gains it nothing a cell cannot do anyway -- it still runs only inside later calls, under their limits.
"""

from __future__ import annotations

import os
import platform

_READ = {"x86_64": b"0", "aarch64": b"63"}.get(platform.machine())  # the read syscall's number
_SWITCHES = (b"voluntary_ctxt_switches", b"nonvoluntary_ctxt_switches")
_INTERPRETER_NSPID = b"2"  # bubblewrap's init is pid 1 of the sandbox and forks the command as pid 2


_REST = (b"State", b"Threads", b"SigCgt", *_SWITCHES)


def _fields(raw: bytes, keys: tuple[bytes, ...]) -> dict[bytes, bytes]:
    """The few ``Key: value`` lines of a /proc status or fdinfo file that the checks below use (bytes.find:
    a regex over the whole file costs ten times more, and this runs after every cell)."""
    raw, out = b"\n" + raw, {}
    for key in keys:
        i = raw.find(b"\n" + key + b":")
        if i >= 0:
            j = raw.find(b"\n", i + 1)
            out[key] = raw[i + len(key) + 2:j if j >= 0 else None].strip()
    return out


def find_interpreter(pids: list[int]) -> int | None:
    """The host pid, among ``pids``, of the sandbox's first process (pid 2 inside its PID namespace)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                nspid = _fields(f.read(), (b"NSpid",)).get(b"NSpid", b"").split()
        except OSError:
            continue
        if len(nspid) == 2 and nspid[1] == _INTERPRETER_NSPID:
            return pid
    return None


def oldest_child(pids: list[int], init: int) -> int | None:
    """The host pid, among ``pids``, of the earliest-started process other than ``init`` (a container's runner,
    started by its init before any cell could fork)."""
    best = None
    for pid in pids:
        if pid == init:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                start = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime
        except (OSError, ValueError, IndexError):
            continue
        if best is None or (start, pid) < best:
            best = (start, pid)
    return None if best is None else best[1]


class IdleProbe:
    """Looks at one sandboxed interpreter (host pid ``pid``) whose cells arrive on ``pipe`` (``pipe:[<ino>]``)."""

    def __init__(self, pid: int, pipe: str):
        self.pid, self.pipe = pid, pipe
        self._status = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
        self._syscall = os.open(f"/proc/{pid}/syscall", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        for fd in (self._status, self._syscall):
            os.close(fd)
        self._status = self._syscall = -1

    def _read(self, fd: int) -> bytes:
        try:
            return os.pread(fd, 4096, 0)
        except OSError:  # the interpreter is gone
            return b""

    def _in_cell_read(self) -> bool:
        """Is the interpreter (its main thread) in a blocking ``read`` of the cell pipe, and not on a CPU?"""
        words = self._read(self._syscall).split(b" ", 2)
        if len(words) < 2 or words[0] != _READ:
            return False  # "running", "-1 ..." (user mode), or another syscall
        try:
            fd = int(words[1], 16)
            if os.readlink(f"/proc/{self.pid}/fd/{fd}") != self.pipe:
                return False
            info = os.open(f"/proc/{self.pid}/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                flags = _fields(os.read(info, 4096), (b"flags",)).get(b"flags", b"4000")
            finally:
                os.close(info)
            return not int(flags, 8) & os.O_NONBLOCK  # a non-blocking read returns at once: a spinning loop
        except (OSError, ValueError):
            return False

    def idle(self, tasks_at_rest: bool) -> bool:
        """The no-freeze proof (see the module docstring); ``tasks_at_rest``: the cgroup holds exactly the
        resting sandbox's tasks."""
        if not tasks_at_rest:
            return False
        first = _fields(self._read(self._status), _SWITCHES)
        if not first or not self._in_cell_read():
            return False
        last = _fields(self._read(self._status), _REST)
        return (last.get(b"State", b"").startswith(b"S") and last.get(b"Threads") == b"1"
                and last.get(b"SigCgt", b"1").strip(b"0") == b""
                and all(first.get(k) == last.get(k) is not None for k in _SWITCHES))

    def frozen_at_read(self) -> bool:
        """With the cgroup frozen: is the main thread stopped inside a blocking read of the cell pipe? (On an
        architecture whose syscall numbers are not known here: True, the freeze alone still fences the cell.)"""
        return _READ is None or self._in_cell_read()


class CellBoundary:
    """The host's side of the boundary for one session's sandbox: its cgroup, how many tasks it holds at rest, and
    ``locate() -> (interpreter host pid, cell pipe name) | None``, asked once, at the first end of a cell."""

    def __init__(self, cgroup, rest_tasks: int, locate):
        self.cgroup, self.rest_tasks, self.locate = cgroup, rest_tasks, locate
        self._probe: IdleProbe | None = None

    def _find(self) -> IdleProbe | None:
        if self._probe is None:
            found = self.locate()
            if found is not None and found[0] is not None:
                try:
                    self._probe = IdleProbe(*found)
                except OSError:  # it exited meanwhile
                    return None
        return self._probe

    def at_rest(self) -> bool:
        """Idle without a freeze when provable (~20 us), else freeze the whole tree (~0.3 ms) and require its
        interpreter stopped in the cell read. False leaves the tree running."""
        group = self.cgroup
        if group.destroyed:
            return True
        if self._find() is None:
            return False
        if self._probe.idle(group.tasks() == self.rest_tasks):
            return True
        if group.freeze() and self._probe.frozen_at_read():
            return True
        group.thaw()
        return False

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None
