"""The ``docker`` backend: one container per fresh run or session, driven through the Docker SDK for Python.

Each container gets an init process (``init=True``: the runner is not PID 1, which would ignore the kernel's
SIGXCPU and so the CPU limit), ``network_mode=none``, a memory cgroup limit with no extra swap, a CPU quota
(``cpus``), a pids limit (``Limits.max_processes``, the per-container process cap; the runner's RLIMIT_NPROC is
asked to be open here, because without user namespaces it would count every container's processes of the same
uid, and the runner never sets it above the container's hard limit), a read-only root, a size-capped tmpfs
``/tmp`` (``Limits.disk_mb``) as the only writable place (``/dev/shm`` is cut to 1 MB), ``no-new-privileges``,
all capabilities dropped, an unprivileged user (65534 by default), no logging driver (output only travels over the
attach stream, capped by the host) and an empty environment. The seccomp profile is the bubblewrap backend's
(:func:`.seccomp_filter.docker_profile`: the same denials, Docker's default ones included, and unlike Docker's
default also ``ptrace`` and ``process_vm_*``), so both backends deny the same calls. The memory cgroup counts
shared memory and tmpfs, and the container's ``OOMKilled`` sets ``memory_exceeded``.

The image is configurable and needs a ``python3``. By default: ``$AGENTENV_DOCKER_IMAGE`` if set, else the first of
:data:`DEFAULT_IMAGES` the engine already has (``scripts/ci_docker.sh`` builds ``agentenv-python:3.11`` offline
from the host's interpreter), else ``python:3.11-slim`` (which the engine then pulls).

Code and output travel over one attach socket (Docker multiplexes stdout/stderr in 8-byte-header frames, decoded
by :func:`demux`). Killing = ``remove(force=True)``, which takes every process in the container with it.
Containers carry the label ``agentenv.sandbox=1`` and labels naming their host process (pid, its start time, the boot):
nothing outlives the host (:mod:`.docker_reaper`: a watchdog removes a dead host's containers at once, and the first
Docker sandbox of every process removes those of any host that is gone).
A session call ends only when the host proves the runner back at its read through the container's own cgroup (found
from its init's pid) and ``/proc``, as for bubblewrap (:mod:`.boundary`), freezing the container when anything else
could run; because the engine relays output with a delay, the host then flushes the streams with an empty cell (see
:func:`.base._settle`). Where the host cannot reach the container's cgroup (a remote engine), nothing is proven or
frozen and the end-of-cell marker is all there is.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import struct

from agentenv.sandboxes import cgroups, docker_reaper
from agentenv.sandboxes.boundary import CellBoundary, oldest_child
from agentenv.sandboxes.base import RUNNER_SOURCE, Sandbox, runner_args
from agentenv.sandboxes.seccomp_filter import docker_profile
from agentenv.sandboxes.limits import Limits

log = logging.getLogger(__name__)
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
LABEL = docker_reaper.LABEL
DEFAULT_IMAGES = ("python:3.11-slim", "agentenv-python:3.11")
_PROFILE = json.dumps(docker_profile(), separators=(",", ":"))


def default_image(client) -> str:
    """``$AGENTENV_DOCKER_IMAGE``, else the first of :data:`DEFAULT_IMAGES` present locally, else the first one."""
    if os.environ.get("AGENTENV_DOCKER_IMAGE"):
        return os.environ["AGENTENV_DOCKER_IMAGE"]
    for name in DEFAULT_IMAGES:
        try:
            client.images.get(name)
            return name
        except Exception:  # docker.errors.ImageNotFound, or an API error: try the next one
            continue
    return DEFAULT_IMAGES[0]


def demux(buf: bytearray) -> list[tuple[int, bytes]]:
    """Consume every complete ``[stream, 0, 0, 0, size:u32be] payload`` frame at the front of ``buf``."""
    frames = []
    while len(buf) >= 8:
        stream, size = buf[0], struct.unpack(">I", buf[4:8])[0]
        if len(buf) < 8 + size:
            break
        if stream in (1, 2):
            frames.append((stream, bytes(buf[8:8 + size])))
        del buf[:8 + size]
    return frames


def container_config(image: str, python: str, mode: str, limits: Limits, cpus: float, user: str) -> dict:
    """Keyword arguments for ``client.containers.create`` (pure, so the hardening is testable without an engine)."""
    from docker.types import LogConfig, Ulimit

    mode += "-mux"  # stdout/stderr may be reordered over the attach stream: the runner marks the end of each
    args = runner_args(mode, limits.replace(max_processes=1 << 20))  # pids_limit is the process cap here
    return dict(
        image=image, command=[python, "-S", "-I", "-c", RUNNER_SOURCE, *args], stdin_open=True, tty=False,
        detach=True, init=True, network_mode="none",
        mem_limit=f"{limits.memory_mb}m", memswap_limit=f"{limits.memory_mb}m",
        nano_cpus=int(cpus * 1e9), pids_limit=limits.max_processes, read_only=True,
        tmpfs={"/tmp": f"rw,nosuid,nodev,size={limits.disk_mb}m,mode=1777"},
        shm_size="1m",  # Docker's default /dev/shm is a 64 MB tmpfs beside /tmp: room for semaphores only
        security_opt=["no-new-privileges", "seccomp=" + _PROFILE], cap_drop=["ALL"], user=user, working_dir="/tmp",
        environment=dict(ENV), ulimits=[Ulimit(name="core", soft=0, hard=0)],
        log_config=LogConfig(type="none"), labels=docker_reaper.owner_labels())


REST_TASKS = 2  # docker's init and the runner: a session with more tasks than this between cells left something


def _locate(group, init: int) -> tuple[int | None, str] | None:
    """The runner (the init's first child) and the cell pipe (the init's stdin, which the runner reads)."""
    try:
        return oldest_child(group.pids(), init), os.readlink(f"/proc/{init}/fd/0")
    except OSError:
        return None


class DockerProc:
    """A started container behind the PipeProc interface (rfds/wfd/read/write/wait/kill/oom_killed)."""

    def __init__(self, client, config: dict, session: bool = False):
        self.container = client.containers.create(**config)
        self.cgroup = self.boundary = None
        try:
            sock = self.container.attach_socket(params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
            self.sock = getattr(sock, "_sock", sock)  # the SDK wraps the hijacked HTTP socket
            self.sock.setblocking(False)
            self.container.start()
            if session:  # the container's own cgroup, frozen between cells (where this host can reach it)
                self.container.reload()
                init = self.container.attrs["State"]["Pid"]
                self.cgroup = cgroups.of_process(init)
                if self.cgroup is not None:
                    self.boundary = CellBoundary(self.cgroup, REST_TASKS, lambda: _locate(self.cgroup, init))
        except BaseException:
            self.container.remove(force=True)
            raise
        self.rfds = [self.sock.fileno()]
        self.wfd = self.rfds[0]
        self.poller = select.poll()
        self.poller.register(self.wfd, select.POLLIN)
        self._buf = bytearray()
        self.mux = True  # one stream carries both: the runner marks each (modes once-mux, session-mux)
        self.oom_killed = False
        self._gone = False

    def read(self, fd):
        try:
            data = self.sock.recv(1 << 16)
        except BlockingIOError:
            return []
        if not data:
            return None
        self._buf += data
        return demux(self._buf)

    def write(self, data) -> int:
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0
        except OSError:
            return len(data)

    def wait(self, timeout):
        try:
            return self.container.wait(timeout=max(timeout, 0.01) if timeout is not None else None)["StatusCode"]
        except Exception:  # the SDK raises requests' timeout/connection errors here
            return None

    def at_rest(self) -> bool:
        """End of a session cell: the same proof as bubblewrap's (:mod:`.boundary`: the runner idle in its read of
        the cell pipe, or the container frozen with the runner stopped there), through the container's own cgroup
        and the engine's processes in this host's ``/proc``. Where the host cannot reach them (a remote engine)
        there is no proof and the marker is all there is."""
        return True if self.boundary is None else self.boundary.at_rest()

    def thaw(self) -> None:
        if self.cgroup is not None and not self.cgroup.destroyed:
            self.cgroup.thaw()

    def kill(self):
        if self._gone:
            return
        self._gone = True
        if self.boundary is not None:
            self.boundary.close()
        if self.cgroup is not None:
            try:
                self.cgroup.thaw()  # a frozen task acts on SIGKILL only once thawed (cgroup v1)
            except OSError:
                pass
            self.cgroup.release()
        # Close our end of the attach stream first: an engine still copying a flood of output into a socket nobody
        # reads would otherwise hold the container's removal until the client's timeout.
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        try:  # an OOM kill has happened by now if there was one; remove(force=True) kills: one API call less
            self.container.reload()
            self.oom_killed = bool(self.container.attrs["State"].get("OOMKilled"))
        except Exception:
            pass
        self.container.remove(force=True)


class DockerSandbox(Sandbox):
    name = "docker"

    def __init__(self, limits: Limits | None = None, *, image: str | None = None, python: str = "python3",
                 cpus: float = 1.0, user: str = "65534:65534", client=None):
        super().__init__(limits)
        try:
            import docker
        except ImportError:
            raise RuntimeError("docker backend: the Docker SDK is missing; `pip install docker`") from None
        if not cpus > 0:
            raise ValueError(f"cpus must be > 0, got {cpus!r}")
        try:
            self.client = client or docker.from_env(timeout=120)  # a vfs engine under load can take seconds per call
            self.client.ping()
        except Exception as e:
            raise RuntimeError(f"docker backend: no Docker engine answers ({type(e).__name__}: {e})") from None
        self.image = image or default_image(self.client)
        self.python, self.cpus, self.user = python, cpus, user

    def _start(self, mode: str, limits: Limits) -> DockerProc:
        docker_reaper.guard(self.client, log)  # once per process (a fork too): dead hosts' containers go; a watchdog
        return DockerProc(self.client, container_config(self.image, self.python, mode, limits, self.cpus, self.user),
                          session=mode == "session")
