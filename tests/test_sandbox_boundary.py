"""The cell boundary of a bubblewrap session: a call ends only when the interpreter is provably back at the
runner's read, and nothing a cell leaves behind (a forged end-of-cell marker, a signal handler on a timer, a
thread, a child) gets CPU between cells. Every check runs real sandboxed processes and measures the tree's CPU
from the host."""

import os
import shutil
import time
import warnings

import pytest

from agentenv.sandboxes import Limits, cgroups, make_sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap)")
LIM = Limits(timeout_s=6, cpu_s=3, memory_mb=128, max_processes=8)

# Writes the runner's own end-of-cell marker (its nonce is in the runner's frame), raises its CPU soft limit,
# then keeps computing for BURN_S of CPU: the old host returned "ok" at once and let it run on.
FORGE = """
import os, resource, sys, time
tag = b"\\0\\x1eAE" + sys._getframe(1).f_locals["nonce"]
os.write(1, tag + b":0:\\0")
resource.setrlimit(resource.RLIMIT_CPU, (100, resource.RLIM_INFINITY))
end = time.process_time() + BURN_S
while time.process_time() < end:
    pass
print("finished burning")
"""
# A SIGALRM handler that computes: whenever the timer fires, between cells too if anything let it run there.
ALARM = """
import signal, time
def burn(*_):
    end = time.monotonic() + 0.005  # a light load: a handler busier than its period starves its own cells
    while time.monotonic() < end:
        pass
signal.signal(signal.SIGALRM, burn)
signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
"""
CHILD = """
import os
if os.fork() == 0:
    while True:
        pass
"""
THREAD = """
import signal, threading
signal.signal(signal.SIGXCPU, signal.SIG_IGN)
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
"""


@pytest.fixture(scope="module")
def sb():
    if cgroups.manager() is None:
        pytest.skip(f"cgroups cannot be delegated here: {cgroups.UNAVAILABLE}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with make_sandbox("bubblewrap", limits=LIM) as s:
            yield s


def tree_cpu_s(session) -> float:
    """CPU seconds (user + system) of every process now in the session's cgroup."""
    total = 0
    for pid in session._proc.cgroup.pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def idle_cpu_s(session, wait_s=1.0) -> float:
    before = tree_cpu_s(session)
    time.sleep(wait_s)
    return tree_cpu_s(session) - before


def test_a_plain_cell_ends_idle_without_a_freeze(sb):
    with sb.session() as s:
        assert s.run("x = 41").ok
        assert s.run("x + 1").stdout == "42\n"
        assert not s._proc.cgroup.frozen  # proved asleep at the runner's read: no freeze needed
        assert idle_cpu_s(s, 0.3) < 0.05


def test_a_forged_marker_does_not_end_the_call(sb):
    with sb.session() as s:
        r = s.run(FORGE.replace("BURN_S", "0.5"))
        assert "finished burning" in r.stdout  # the call lasted until the cell really ended
        assert not r.session_restarted
        assert idle_cpu_s(s) < 0.1
        assert s.run("print('still here')").stdout.endswith("still here\n")


def test_a_forged_marker_on_an_endless_cell_times_out_and_restarts(sb):
    with sb.session() as s:
        s.run("x = 1")
        r = s.run(FORGE.replace("BURN_S", "1000"), LIM.replace(timeout_s=1.5))
        assert r.timed_out and r.session_restarted and "finished burning" not in r.stdout
        assert s.run("'x' in globals()").stdout == "False\n"


def test_a_signal_handler_on_a_timer_gets_no_cpu_between_cells(sb):
    with sb.session() as s:
        assert s.run(ALARM).ok
        assert s._proc.cgroup.frozen  # it catches a signal: only a freeze proves nothing runs
        assert idle_cpu_s(s) < 0.1
        r = s.run("signal.setitimer(signal.ITIMER_REAL, 0); signal.signal(signal.SIGALRM, signal.SIG_DFL); 'calm'")
        assert r.stdout == "'calm'\n" and not s._proc.cgroup.frozen  # no handler left: idle again


@pytest.mark.parametrize("code", [CHILD, THREAD], ids=["child", "thread"])
def test_what_a_cell_leaves_running_gets_no_cpu_between_cells(sb, code):
    with sb.session() as s:
        assert s.run(code).ok
        assert s._proc.cgroup.frozen
        assert idle_cpu_s(s) < 0.1
        assert s.run("print('next cell')").stdout == "next cell\n"


def test_sigint_is_not_caught_by_the_runner(sb):
    """The idle proof needs an interpreter that catches no signal unless a cell asked for it."""
    with sb.session() as s:
        r = s.run("import signal; print(signal.getsignal(signal.SIGINT) is signal.SIG_DFL)")
        assert r.stdout == "True\n"
