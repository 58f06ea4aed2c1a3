"""Docker backend: its hardening and stream decoding are checked offline; live runs need a Docker engine and a
local Python image (``scripts/ci_docker.sh`` starts Debian's engine and builds one offline) and skip, saying why,
without them."""

import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest

from agentenv.sandboxes import Limits, make_sandbox

docker = pytest.importorskip("docker", reason="the Docker SDK is not installed (pip install docker)")
from agentenv.sandboxes.attacks import ATTACKS, LIMITS, Target, judge  # noqa: E402
from agentenv.sandboxes.docker_backend import LABEL, container_config, default_image, demux  # noqa: E402
from agentenv.sandboxes.docker_reaper import BOOT, PID, SCOPE, START, owner_gone, owner_labels, start_time  # noqa: E402


def _engine_error():
    try:
        docker.from_env(timeout=2).ping()
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "no engine"
        return f"{type(e).__name__}: {e}"


def _live_error():
    """Why live Docker tests cannot run here, or None."""
    why = _engine_error()
    if why:
        return f"no Docker engine answers ({why})"
    client = docker.from_env(timeout=30)
    image = default_image(client)
    try:
        client.images.get(image)
    except Exception as e:  # noqa: BLE001 - ImageNotFound or an API error
        return f"the image {image!r} is not present and no registry may be reachable: run scripts/ci_docker.sh ({e})"
    return None


@pytest.fixture(scope="module")
def live():
    why = _live_error()
    if why:
        pytest.skip(why)


def test_container_config_is_hardened():
    lim = Limits(memory_mb=300, max_processes=12, disk_mb=20)
    c = container_config("img:1", "python3", "session", lim, cpus=0.5, user="65534:65534")
    assert c["network_mode"] == "none" and c["read_only"] and c["cap_drop"] == ["ALL"]
    assert c["security_opt"][0] == "no-new-privileges" and c["user"] == "65534:65534"
    profile = json.loads(c["security_opt"][1].removeprefix("seccomp="))
    denied = {n for rule in profile["syscalls"] if "args" not in rule for n in rule["names"]}
    assert {"ptrace", "keyctl", "add_key", "unshare", "mount", "bpf", "userfaultfd"} <= denied
    assert c["mem_limit"] == c["memswap_limit"] == "300m" and c["pids_limit"] == 12
    assert c["nano_cpus"] == 500_000_000 and "size=20m" in c["tmpfs"]["/tmp"] and c["shm_size"] == "1m"
    assert c["environment"]["HOME"] == "/tmp" and "SECRET" not in str(c["environment"])
    assert c["command"][:3] == ["python3", "-S", "-I"] and c["command"][5] == "session-mux"
    assert c["labels"] == owner_labels() and c["labels"][LABEL] == "1" and c["stdin_open"] and not c["tty"]
    assert c["init"]  # the runner is not PID 1, which would ignore the kernel's SIGXCPU


def test_demux_decodes_split_frames():
    frame = lambda stream, data: bytes([stream, 0, 0, 0]) + struct.pack(">I", len(data)) + data  # noqa: E731
    raw = frame(1, b"out") + frame(2, b"err") + frame(1, b"more")
    buf = bytearray(raw[:13])
    got = demux(buf)
    buf += raw[13:]
    got += demux(buf)
    assert got == [(1, b"out"), (2, b"err"), (1, b"more")] and not buf


def test_no_engine_gives_a_clear_error():
    if _engine_error() is None:
        pytest.skip("a Docker engine answers here")
    with pytest.raises(RuntimeError, match="no Docker engine answers"):
        make_sandbox("docker")


@pytest.mark.docker
def test_live_docker_run_and_session(live):
    with make_sandbox("docker", limits=Limits(timeout_s=60)) as sb:
        r = sb.run("import os, socket\nprint(os.getuid())\ntry:\n    socket.create_connection(('1.1.1.1', 53), 2)\n"
                   "    print('net')\nexcept OSError:\n    print('no net')")
        assert r.stdout == "65534\nno net\n", r
        with sb.session() as s:
            s.run("x = 20")
            assert s.run("x + 22").stdout == "42\n"
            r = s.run("import time; time.sleep(30)", Limits(timeout_s=1))
            assert r.timed_out and r.session_restarted


@pytest.fixture(scope="module")
def docker_sandbox(live):
    with make_sandbox("docker", limits=LIMITS) as sb:
        yield sb


@pytest.fixture(scope="module")
def target():
    t = Target(secret_dir="/root" if os.access("/root", os.W_OK) else None)
    yield t
    t.close()


@pytest.mark.docker
@pytest.mark.parametrize("attack", ATTACKS, ids=lambda a: a.name)
def test_live_docker_contains_every_attack(docker_sandbox, target, attack):
    v = judge(docker_sandbox, attack, target)
    assert v.contained, f"{attack.guarantee}: {v.problems}\nstdout: {v.result.stdout[:500]}"


@pytest.mark.docker
def test_live_docker_leaves_no_container_behind(live):
    client = docker.from_env(timeout=30)
    with make_sandbox("docker", limits=LIMITS) as sb:
        with sb.session() as s:
            s.run("x = 1")
            cid = s._proc.container.id
        r = sb.run("import time; time.sleep(30)", LIMITS.replace(timeout_s=0.5))
    assert r.timed_out
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(cid)


# ---- nothing outlives the host: owner labels, the watchdog, the next start's removal ------------------------------

def test_owner_labels_name_a_live_owner_and_a_dead_one_is_provably_gone():
    me = owner_labels()
    assert me[PID] == str(os.getpid()) and me[START].isdigit() and me[BOOT]
    assert not owner_gone(me)  # this very process
    assert owner_gone({**me, START: str(int(me[START]) + 1)})  # the pid recycled: another process holds it
    assert owner_gone({**me, BOOT: "another-boot"})
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert owner_gone({**me, PID: done.stdout.strip()})  # exited (or its pid recycled since: a later start time)
    assert not owner_gone({**me, PID: done.stdout.strip(), SCOPE: "elsewhere/pid:[1]"})  # not ours to judge
    assert not owner_gone({LABEL: "1"})  # no owner named: left alone


HOST = """
import time
from agentenv.sandboxes import Limits, make_sandbox
from agentenv.sandboxes import docker_reaper
s = make_sandbox("docker", limits=Limits(timeout_s=60)).session()
s.run("x = 1")
print(s._proc.container.id, docker_reaper._watchdog.pid, flush=True)
time.sleep(120)
"""


def _gone(client, cid: str, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while True:
        try:
            client.containers.get(cid)
        except docker.errors.NotFound:
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)


@pytest.mark.docker
def test_live_docker_watchdog_removes_a_sigkilled_hosts_container(live):
    client = docker.from_env(timeout=60)
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    try:
        cid, watchdog = host.stdout.readline().split()
        assert client.containers.get(cid).status == "running"
        host.send_signal(signal.SIGKILL)
        host.wait()
        assert _gone(client, cid, timeout=60), f"container {cid[:12]} outlived its SIGKILLed host"
        assert _exits(int(watchdog)), "the watchdog outlived its work"
    finally:
        host.kill()
        host.wait()
        try:
            client.api.remove_container(cid, force=True)
        except Exception:  # noqa: BLE001 - removed, as it should be (or never created)
            pass


def _exits(pid: int, timeout: float = 10) -> bool:
    end = time.monotonic() + timeout
    while start_time(pid) is not None and time.monotonic() < end:
        time.sleep(0.1)
    return start_time(pid) is None


@pytest.mark.docker
def test_live_docker_next_start_removes_dead_hosts_containers_and_keeps_live_ones(live):
    client = docker.from_env(timeout=60)
    me = owner_labels()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owners = {"exited": {**me, PID: dead.stdout.strip()}, "recycled": {**me, START: str(int(me[START]) + 1)},
              "rebooted": {**me, BOOT: "another-boot"}, "live": me,
              "elsewhere": {**me, PID: dead.stdout.strip(), SCOPE: "elsewhere/pid:[1]"}}
    made = {k: client.containers.create(default_image(client), ["python3", "-c", "pass"], labels=v,
                                        network_mode="none").id for k, v in owners.items()}
    try:
        nxt = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig()\n"
                              "from agentenv.sandboxes import make_sandbox\n"
                              "print(make_sandbox('docker').run('print(1)').stdout)"],
                             capture_output=True, text=True, timeout=120)
        assert nxt.stdout.strip() == "1", nxt.stderr
        left = {k for k, cid in made.items() if not _gone(client, cid, 0)}
        assert left == {"live", "elsewhere"}, nxt.stderr
        assert "left by dead host processes" in nxt.stderr
        assert all(made[k][:12] in nxt.stderr for k in ("exited", "recycled", "rebooted")), nxt.stderr
    finally:
        for cid in made.values():
            try:
                client.api.remove_container(cid, force=True)
            except Exception:  # noqa: BLE001 - already removed by the start under test
                pass
