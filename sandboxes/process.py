"""Host-side handle on one sandboxed process tree started with pipes (bubblewrap and subprocess backends).

Contract:

* :class:`PipeProc` starts ``argv`` in a new session (so its process group is the whole tree the backend does not
  move elsewhere) with stdin/stdout/stderr pipes, all non-blocking. ``kill()`` SIGKILLs that process group and
  reaps the leader; it is idempotent. For bubblewrap the group leader is the outer ``bwrap``, and killing it takes
  the sandbox's whole PID namespace with it (``--die-with-parent``), whatever the code inside did.
* Every live PipeProc is registered; :func:`kill_all` runs at interpreter exit, so no sandbox outlives its host.
* All processes are started from one long-lived spawner thread. Both bubblewrap's ``--die-with-parent`` and
  ``PR_SET_PDEATHSIG`` fire when the *thread* that forked the child exits, so a session opened inside a short-lived
  worker thread would otherwise die with that thread.
* With a :class:`~agentenv.sandboxes.cgroups.Cgroup` the child joins it before ``exec`` (every process of the
  tree is then counted and limited by it), ``kill()`` also kills every task left in it and removes it, and
  ``oom_killed`` reads its OOM counter (True once per OOM kill since it was last read). ``at_rest()`` ends a
  session cell: it proves the interpreter idle at the runner's read, or freezes the whole tree and proves it
  stopped there (:mod:`.boundary`); ``thaw()`` resumes the tree for the next cell. Without a cgroup neither
  proves anything.
* The same read/write/kill/wait interface is implemented by the docker backend's container handle;
  :mod:`agentenv.sandboxes.channel` only talks to that interface.
"""

from __future__ import annotations

import atexit
import os
import select
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

from agentenv.sandboxes.boundary import CellBoundary, find_interpreter

_lock = threading.Lock()
_live: set[PipeProc] = set()
_spawner: ThreadPoolExecutor | None = None
_spawner_pid = 0


def _spawn(fn, *args, **kwargs):
    global _spawner, _spawner_pid
    with _lock:
        if _spawner is None or _spawner_pid != os.getpid():  # after fork() the old thread does not exist here
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="agentenv-sandbox-spawner")
            _spawner_pid = os.getpid()
        spawner = _spawner
    return spawner.submit(fn, *args, **kwargs).result()


def exit_code(returncode: int | None) -> int | None:
    """Shell convention on every backend: killed by signal N -> 128 + N (Popen says -N, bwrap already says 128 + N)."""
    return None if returncode is None else (128 - returncode if returncode < 0 else returncode)


class PipeProc:
    def __init__(self, argv: list[str], env: dict[str, str], cwd: str | None = None, cgroup=None,
                 pass_fds: tuple[int, ...] = (), rest_tasks: int = 1):
        self.cgroup = cgroup
        self.rest_tasks = rest_tasks
        if cgroup is not None:
            argv = cgroup.join_argv(argv)
        self.popen = _spawn(subprocess.Popen, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True, close_fds=True,
                            pass_fds=pass_fds)
        self.pid = self.popen.pid
        self.wfd = self.popen.stdin.fileno()
        self._streams = {self.popen.stdout.fileno(): 1, self.popen.stderr.fileno(): 2}
        self.rfds = list(self._streams)
        self.exit_fd = os.pidfd_open(self.pid)  # readable once the leader exits, even if a daemon keeps the pipes
        self.poller = select.poll()  # kept across session calls; channel.pump adds stdin only while it writes
        for fd in (*self.rfds, self.exit_fd):
            self.poller.register(fd, select.POLLIN)
        for fd in (self.wfd, *self.rfds):
            os.set_blocking(fd, False)
        self.mux = False  # separate pipes per stream: see channel.pump
        self._oom_at_kill = False
        self.boundary = None if cgroup is None else CellBoundary(cgroup, rest_tasks, self._locate)
        with _lock:
            _live.add(self)

    def read(self, fd: int) -> list[tuple[int, bytes]] | None:
        """[(stream, data)] from one readable fd; [] if nothing after all; None at end of file."""
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return []
        return [(self._streams[fd], data)] if data else None

    def write(self, data: memoryview) -> int:
        try:
            return os.write(self.wfd, data)
        except BlockingIOError:
            return 0
        except (BrokenPipeError, OSError):
            return len(data)  # the reader is gone; the pump sees its end of file next

    def wait(self, timeout: float | None) -> int | None:
        """Exit code, or None if still running after ``timeout`` s (a pidfd wakes us at once, no sleep polling)."""
        if timeout is not None and self.popen.returncode is None and self.exit_fd is not None:
            poller = select.poll()
            poller.register(self.exit_fd, select.POLLIN)
            poller.poll(max(timeout, 0) * 1000)
        try:
            return exit_code(self.popen.wait(None if timeout is None else 0))
        except subprocess.TimeoutExpired:
            return None

    @property
    def oom_killed(self) -> bool:
        """Did the cgroup's OOM killer kill a task since this was last read (RLIMIT_AS shows up as MemoryError)."""
        if self.cgroup is None:
            return False
        if self.cgroup.destroyed:
            seen, self._oom_at_kill = self._oom_at_kill, False
            return seen
        return self.cgroup.new_oom_kill()

    def _locate(self) -> tuple[int | None, str]:
        return find_interpreter(self.cgroup.pids()), f"pipe:[{os.fstat(self.wfd).st_ino}]"

    def at_rest(self) -> bool:
        """After an end-of-cell marker: is the interpreter provably back at the runner's read, with nothing else
        able to run until the next cell (:mod:`.boundary`)? False leaves the tree running. Without a cgroup there
        is no such proof: True, and cells are bounded only per call."""
        return True if self.boundary is None else self.boundary.at_rest()

    def thaw(self) -> None:
        if self.cgroup is not None and not self.cgroup.destroyed:
            self.cgroup.thaw()

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.cgroup is not None and not self.cgroup.destroyed:
            self._oom_at_kill = self.cgroup.destroy()  # also the tasks that left the process group
        if self.boundary is not None:
            self.boundary.close()
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:  # the leader is in uninterruptible sleep; the registry retries at exit
            return
        for f in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            try:
                f.close()
            except OSError:
                pass
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None
        with _lock:
            _live.discard(self)


@atexit.register
def kill_all() -> None:
    with _lock:
        procs = list(_live)
    for p in procs:
        p.kill()
