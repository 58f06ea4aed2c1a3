"""Nothing outlives the host: kill every task left in a dead host's sandbox cgroups, frozen ones included.

A frozen task does not act on SIGKILL until it is thawed (cgroup v1), so a host killed while a session sat frozen
between cells leaves bwrap, the interpreter and its children stopped forever, holding their memory. Two layers:

* :func:`start_watchdog` starts one small process per host (this file, run as ``python -S -I reaper.py DIR...``)
  that blocks reading a pipe whose only write end the host holds. When the host dies, however it dies, the read
  returns end of file and the watchdog reaps the host's groups, then exits. It is in its own session, so a signal
  to the host's process group does not take it along.
* :func:`reap` is also run by the next host process's cgroup manager over the groups of every host that is gone
  (for a watchdog that was killed too), see :mod:`.cgroups`.

Reaping a group: SIGKILL every task in each leaf ``sb-*`` (v2: ``cgroup.kill``, which acts on frozen tasks),
then thaw it so the kills take effect (v1), then remove the leaves and the parent once they are empty (waiting up
to ``wait_s``; a leaf still busy is left for the next start). Only the standard library: the watchdog imports
nothing of agentenv.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError:
        pass


def _kill_leaf(leaf: Path) -> None:
    if (leaf / "cgroup.kill").exists():
        _write(leaf / "cgroup.kill", "1")
    try:
        pids = (leaf / "cgroup.procs").read_text().split()
    except OSError:
        pids = []
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    if (leaf / "freezer.state").exists():
        _write(leaf / "freezer.state", "THAWED")
    elif (leaf / "cgroup.freeze").exists():
        _write(leaf / "cgroup.freeze", "0")


def reap(parents: list[Path], wait_s: float = 2.0) -> bool:
    """Kill everything in the ``sb-*`` leaves of each parent, thaw them, remove leaves and parents. True if all
    are gone within ``wait_s``."""
    for p in parents:
        for leaf in p.glob("sb-*"):
            _kill_leaf(leaf)
    deadline = time.monotonic() + wait_s
    while True:
        busy = False
        for p in parents:
            for d in [*p.glob("sb-*"), p]:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    busy = True
        if not busy or time.monotonic() > deadline:
            return not busy
        time.sleep(0.02)


def start_watchdog(parents: list[Path]) -> subprocess.Popen:
    """A process that reaps ``parents`` as soon as this host process is gone (see the module docstring)."""
    return spawn_pipe_watchdog([sys.executable, "-S", "-I", __file__, *map(str, parents)])


def spawn_pipe_watchdog(argv: list[str]) -> subprocess.Popen:
    """Start ``argv`` in its own session with stdin the read end of a pipe whose only write end this host holds
    (``proc.host_end``): the watchdog's read returns end of file exactly when the host is gone, however it died.
    Shared by the cgroup reaper here and :mod:`.docker_reaper`."""
    r, w = os.pipe()  # both close-on-exec: no sandbox and no other child of the host inherits the write end
    try:
        proc = subprocess.Popen(argv, stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    finally:
        os.close(r)
    proc.host_end = w  # held open for the host's lifetime; its closing is the watchdog's signal
    return proc


def _watch(dirs: list[str]) -> None:
    while os.read(0, 4096):
        pass
    reap([Path(d) for d in dirs], wait_s=5.0)


if __name__ == "__main__":
    _watch(sys.argv[1:])
