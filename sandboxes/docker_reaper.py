"""Nothing outlives the host, Docker side: every container names its owner, and the owner's death removes it.

A container is the engine's, not the host's child: when the host process is SIGKILLed, its containers keep running
(the bubblewrap backend's ``--die-with-parent`` and cgroup reaper, :mod:`.reaper`, have no hold on them). So each
container the Docker backend creates carries labels naming its owner (:func:`owner_labels`):

* ``agentenv.sandbox=1`` (every container of ours), ``agentenv.host.pid``, ``agentenv.host.start`` (that pid's
  start time in clock ticks, field 22 of ``/proc/<pid>/stat``: a recycled pid is not mistaken for the owner) and
  ``agentenv.host.boot`` (``/proc/sys/kernel/random/boot_id``);
* ``agentenv.host``: the hostname and the pid namespace of the owner. Pids and start times mean something only in
  the namespace they were read in, and an engine can be shared (a remote ``DOCKER_HOST``, a socket mounted into
  several containers): a container of another machine or namespace is never judged, so never touched.

Two layers, as for bubblewrap's cgroups:

* :func:`guard` runs at the first Docker sandbox of each process (a forked child counts as a new process): it
  force-removes every container of our scope whose owner is provably gone (another boot, its pid absent, or that
  pid started at another time) and logs how many and which; then it starts the watchdog. Containers of live hosts,
  and ours without owner labels, are left alone.
* The watchdog (this file, run as ``python -I docker_reaper.py SYS_PATH OWNER``): one small process per host that
  blocks reading a pipe whose only write end the host holds. When the host dies, however it dies, the kernel closes
  that end, the read returns end of file, and the watchdog removes every container labelled with exactly this
  host's owner labels (through the Docker SDK at the host's ``sys.path`` and ``DOCKER_*`` environment), then exits.
  It sits in its own session (a signal to the host's process group does not take it along) and costs nothing while
  it waits: no CPU, and nothing but the standard library imported until the host is gone.

Why a host-side watchdog fed by a pipe, and not the alternatives: the container cannot notice its host's death by
itself (no fd crosses into a container without a shared mount, which the read-only, network-less container must not
have); ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the watchdog exits, not the process, so a sandbox
first used from a worker thread would be reaped while its host lives, and it needs ``prctl`` through ctypes;
polling the host's pid costs wake-ups and a detection delay, and must itself guard against pid reuse. A pipe's end
of file is exact, immediate and free. What it cannot cover: a watchdog killed together with its host (a SIGKILL to
the whole session, an OOM kill of both) -- the next start's :func:`guard` removes those containers; a client given
to :class:`.docker_backend.DockerSandbox` explicitly is not passed on (the watchdog uses ``docker.from_env``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

LABEL = "agentenv.sandbox"
SCOPE, PID, START, BOOT = "agentenv.host", "agentenv.host.pid", "agentenv.host.start", "agentenv.host.boot"


def start_time(pid: int | str) -> str | None:
    """Field 22 of ``/proc/<pid>/stat`` (clock ticks since boot), or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # after the comm field, which may hold spaces and parentheses


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def scope() -> str:
    """``hostname/pid:[inode]``: where this process's pids mean what they say."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "pid:?"
    return f"{socket.gethostname()}/{ns}"


def owner_labels(pid: int | None = None) -> dict[str, str]:
    """The labels of a container owned by ``pid`` (default: this process)."""
    pid = pid or os.getpid()
    return {LABEL: "1", SCOPE: scope(), PID: str(pid), START: start_time(pid) or "", BOOT: _boot_id()}


def owner_gone(labels: dict) -> bool:
    """True only when the container's owner provably is gone: it is of our scope, and either of another boot, or its
    pid is absent or started at another time. False for a live owner, another scope, or no owner labels."""
    if labels.get(SCOPE) != scope() or not str(labels.get(PID, "")).isdigit() or not labels.get(START):
        return False
    if labels.get(BOOT) != _boot_id():
        return True
    return start_time(labels[PID]) != labels[START]


def remove_where(client, match) -> list[str]:
    """Force-remove every container with our label whose labels satisfy ``match``; ``"<short id> (host pid N)"`` for
    each one this call removed (one another host or the watchdog removed first is skipped)."""
    removed = []
    for c in client.api.containers(all=True, filters={"label": f"{LABEL}=1"}):
        labels = c.get("Labels") or {}
        if not match(labels):
            continue
        try:
            client.api.remove_container(c["Id"], force=True)
        except Exception:  # noqa: BLE001 - gone already (404) or being removed by someone else (409)
            continue
        removed.append(f"{c['Id'][:12]} (host pid {labels.get(PID)})")
    return removed


def start_watchdog() -> subprocess.Popen:
    """The process that removes this host's containers as soon as the host is gone (see the module docstring)."""
    from .reaper import spawn_pipe_watchdog  # here, not at the top: this file also runs as the watchdog script

    path = json.dumps([p for p in sys.path if p])  # the same Docker SDK (and its dependencies) as the host's
    return spawn_pipe_watchdog([sys.executable, "-I", __file__, path, json.dumps(owner_labels())])


_guarded_pid = 0
_watchdog: subprocess.Popen | None = None
_lock = threading.Lock()


def guard(client, log) -> None:
    """Once per process: remove the containers of dead hosts (logged), then start this host's watchdog (a failure
    to start it is logged: the next start's removal still covers this host)."""
    global _guarded_pid, _watchdog
    with _lock:
        if _guarded_pid == os.getpid():
            return
        _guarded_pid = os.getpid()
        try:
            removed = remove_where(client, owner_gone)
        except Exception as e:  # noqa: BLE001 - an engine error must not stop the sandbox from starting
            log.warning("agentenv docker sandboxes: could not look for containers of dead hosts (%s)", e)
            removed = []
        if removed:
            log.warning("agentenv docker sandboxes: removed %d container(s) left by dead host processes: %s",
                        len(removed), ", ".join(removed))
        try:
            _watchdog = start_watchdog()
        except OSError as e:
            log.warning("agentenv docker sandboxes: no watchdog (%s); a SIGKILLed host's containers are removed "
                        "only by the next Docker sandbox start", e)


def _watch(path: str, owner: str) -> None:
    while os.read(0, 4096):
        pass
    sys.path[:0] = json.loads(path)
    import docker

    me = json.loads(owner)
    remove_where(docker.from_env(timeout=120), lambda labels: all(labels.get(k) == v for k, v in me.items()))


if __name__ == "__main__":
    _watch(*sys.argv[1:3])
