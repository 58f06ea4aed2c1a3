"""Nothing outlives the host: a host SIGKILLed while its session sits frozen between cells leaves no sandbox
process behind -- its watchdog reaps it at once, and if the watchdog was killed too, the next sandbox start does.
Real host processes, real frozen bubblewrap sessions."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from agentenv.sandboxes import cgroups

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap)")

HOST = textwrap.dedent("""
    import os, time
    from agentenv.sandboxes import Limits, cgroups, make_sandbox
    s = make_sandbox("bubblewrap", limits=Limits(timeout_s=30, cpu_s=30)).session()
    r = s.run("import os, threading, time\\n"
              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\\n"
              "if os.fork() == 0:\\n    time.sleep(60)\\n    os._exit(0)\\n"
              "os.getuid()")
    print(r.stdout.strip(), cgroups.manager().watchdog.pid, s._proc.cgroup.frozen, flush=True)
    time.sleep(60)
""")


def procs_of_uid(uid: int) -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/status") as f:
                st = f.read()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in st and "State:\tZ" not in st:
            out.append(int(d))
    return out


def gone_soon(uid: int, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while procs_of_uid(uid):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def frozen_host():
    if cgroups.manager() is None:
        pytest.skip(f"cgroups cannot be delegated here: {cgroups.UNAVAILABLE}")
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    uid, watchdog, frozen = host.stdout.readline().split()
    assert frozen == "True" and len(procs_of_uid(int(uid))) == 2  # the interpreter, its child
    yield host, int(uid), int(watchdog)
    host.kill()
    host.wait()


def test_the_watchdog_reaps_a_frozen_session_when_its_host_is_sigkilled(frozen_host):
    host, uid, _ = frozen_host
    host.send_signal(signal.SIGKILL)
    host.wait()
    assert gone_soon(uid), f"frozen sandbox processes {procs_of_uid(uid)} outlived their SIGKILLed host"


def test_the_next_start_reaps_a_frozen_orphan_whose_watchdog_died_too(frozen_host):
    host, uid, watchdog = frozen_host
    os.kill(watchdog, signal.SIGKILL)
    host.send_signal(signal.SIGKILL)
    host.wait()
    time.sleep(0.5)
    assert procs_of_uid(uid), "the frozen orphan should exist until someone reaps it"  # the failure being fixed
    nxt = subprocess.run([sys.executable, "-c", "from agentenv.sandboxes import make_sandbox\n"
                          "print(make_sandbox('bubblewrap').run('print(1)').stdout)"],
                         capture_output=True, text=True, timeout=60)
    assert nxt.stdout.strip() == "1", nxt.stderr
    assert gone_soon(uid), f"frozen sandbox processes {procs_of_uid(uid)} survived the next sandbox start"
