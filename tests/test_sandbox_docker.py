"""Docker backend: its hardening and stream decoding are checked offline; live runs need a Docker engine."""

import struct

import pytest

from agentenv.sandboxes import Limits, make_sandbox

docker = pytest.importorskip("docker", reason="the Docker SDK is not installed (pip install docker)")
from agentenv.sandboxes.docker_backend import LABEL, container_config, demux  # noqa: E402


def _engine_error():
    try:
        docker.from_env(timeout=2).ping()
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "no engine"
        return f"{type(e).__name__}: {e}"


def test_container_config_is_hardened():
    lim = Limits(memory_mb=300, max_processes=12, disk_mb=20)
    c = container_config("img:1", "python3", "session", lim, cpus=0.5, user="65534:65534")
    assert c["network_mode"] == "none" and c["read_only"] and c["cap_drop"] == ["ALL"]
    assert c["security_opt"] == ["no-new-privileges"] and c["user"] == "65534:65534"
    assert c["mem_limit"] == c["memswap_limit"] == "300m" and c["pids_limit"] == 12
    assert c["nano_cpus"] == 500_000_000 and "size=20m" in c["tmpfs"]["/tmp"]
    assert c["environment"]["HOME"] == "/tmp" and "SECRET" not in str(c["environment"])
    assert c["command"][:3] == ["python3", "-S", "-I"] and c["command"][5] == "session-mux"
    assert c["labels"] == {LABEL: "1"} and c["stdin_open"] and not c["tty"]


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
def test_live_docker_run_and_session():
    why = _engine_error()
    if why:
        pytest.skip(f"no Docker engine answers ({why})")
    with make_sandbox("docker", limits=Limits(timeout_s=60)) as sb:
        r = sb.run("import os, socket\nprint(os.getuid())\ntry:\n    socket.create_connection(('1.1.1.1', 53), 2)\n"
                   "    print('net')\nexcept OSError:\n    print('no net')")
        assert r.stdout == "65534\nno net\n", r
        with sb.session() as s:
            s.run("x = 20")
            assert s.run("x + 22").stdout == "42\n"
            r = s.run("import time; time.sleep(30)", Limits(timeout_s=1))
            assert r.timed_out and r.session_restarted
