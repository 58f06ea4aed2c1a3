"""Sandbox behaviour with real bubblewrap processes: fresh runs, sessions, limits, clean-up, pool, concurrency."""

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agentenv.sandboxes import ExecResult, Limits, SandboxPool, available_backends, make_sandbox
from agentenv.sandboxes.channel import Sink
from agentenv.sandboxes.limits import TRUNCATION_MARKER
from agentenv.sandboxes.unsafe import UnsafeSandboxWarning

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap)")
FAST = Limits(timeout_s=5.0, cpu_s=5.0, memory_mb=256, max_processes=16)


@pytest.fixture(scope="module")
def sb():
    with make_sandbox("bubblewrap", limits=FAST) as s:
        yield s


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except OSError:
        return False


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


def gone_soon(check, timeout=2.0) -> bool:
    end = time.monotonic() + timeout
    while check():
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


# ---- values --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(timeout_s=0), dict(timeout_s=-1), dict(cpu_s=True), dict(memory_mb=8),
                                 dict(max_processes=0), dict(max_output_bytes=1.5), dict(disk_mb="64")])
def test_limits_reject_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Limits(**bad)


def test_exec_result_ok_and_dict():
    r = ExecResult(stdout="x", exit_code=0)
    assert r.ok and r.to_dict()["ok"] and r.to_dict()["stdout"] == "x"
    assert not ExecResult(exit_code=0, output_truncated=True).ok
    assert not ExecResult(exit_code=1).ok


def test_sink_strips_a_marker_split_across_reads_and_caps():
    tag = b"\0\x1eAEabc"
    s = Sink(5, tag)
    for piece in (b"hello wor", b"ld\0\x1e", b"AEab", b"c:0:\0", b"tail"):
        s.feed(piece)
    assert s.found and s.status == b":0:"
    assert s.text() == "hello" + TRUNCATION_MARKER.format(dropped=len(" worldtail"))
    plain = Sink(100, tag)
    plain.feed(b"a\0b\0")
    assert plain.text() == "a\0b\0" and not plain.found


def test_sink_strips_every_marker_keeps_the_last_status_and_awaits_a_flush():
    """A cell can write its runner's marker itself: every copy is stripped, the last one (the runner's, written
    just before its read) gives the status, and a flush tag is awaited on top."""
    tag, flush = b"\0\x1eAEabc", b"\0\x1eAEf00"
    s = Sink(100, tag)
    s.feed(b"one" + tag + b":0:\0two" + tag[:3])
    assert s.found and s.status == b":0:"
    s.expect(flush)
    assert not s.found
    s.feed(tag[3:] + b":1:ValueError\0three" + flush + b":0:\0")
    assert s.found and s.status == b":1:ValueError" and s.text() == "onetwothree"


def test_bad_inputs(sb):
    with pytest.raises(TypeError):
        sb.run(b"print(1)")
    with pytest.raises(TypeError):
        sb.run("print(1)", limits={"timeout_s": 1})
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        make_sandbox("chroot")


# ---- fresh runs ----------------------------------------------------------------------------------------------

def test_fresh_run_ends_like_a_script_after_its_threads_and_atexit_handlers(sb):
    """The end marker that ends a fresh run comes after what ``python file.py`` still runs at exit, and a forked
    child that exits normally does not end its parent's run."""
    r = sb.run("import atexit, os, sys, threading, time\n"
               "if os.fork() == 0:\n    sys.exit(0)\nos.wait()\n"
               "atexit.register(print, 'atexit')\n"
               "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
               "print('main')\nsys.exit(259)")
    assert r.stdout.split() == ["main", "thread", "atexit"] and r.exit_code == 3


def test_fresh_run_basics(sb):
    r = sb.run("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (r.stdout, r.stderr, r.exit_code, r.ok, r.backend) == ("out\n", "err\n", 0, True, "bubblewrap")
    assert sb.run("x = 1").stdout == ""  # like a script: no echo of values
    r = sb.run("def f():\n    return 1 / 0\nf()")
    assert r.exit_code == 1 and 'File "<cell>", line 2, in f' in r.stderr and "return 1 / 0" in r.stderr
    assert "ZeroDivisionError" in r.stderr and not r.ok
    assert sb.run("import sys; sys.exit(7)").exit_code == 7
    assert "SyntaxError" in sb.run("def (").stderr
    assert sb.run("import os; os.kill(os.getpid(), 9)").exit_code == 128 + 9
    assert "EOF" in sb.run("input()").stderr  # stdin is not the control channel


def test_fresh_runs_share_nothing(sb):
    sb.run("open('/tmp/left', 'w').write('x')")
    assert "FileNotFoundError" in sb.run("open('/tmp/left').read()").stderr


def test_ready_sandboxes_are_fresh_own_uid_and_die_with_their_sandbox():
    sb = make_sandbox("bubblewrap", limits=FAST, ready=2)
    assert sb.run("pass").ok and sb._ready._thread is None  # one run starts nothing extra
    first = sb.run("import os\nopen('/tmp/left', 'w').write('x')\nprint(os.getuid())")
    assert gone_soon(lambda: len(sb._ready._ready) < 2, timeout=30)  # the queue filled in the background
    waiting = list(sb._ready._ready)
    second = sb.run("import os\nprint(os.path.exists('/tmp/left'), os.getuid())")
    assert second.stdout.split()[0] == "False" and second.stdout.split()[1] != first.stdout.strip()
    assert sb.run("print(3)", FAST.replace(memory_mb=300)).stdout == "3\n"  # other limits: started at the call
    tasks = [pid for p in waiting for pid in (p.cgroup.pids() if not p.cgroup.destroyed else [])]
    assert tasks  # the one not taken yet is up, with its namespaces and interpreter
    sb.close()
    assert gone_soon(lambda: any(alive(pid) for pid in tasks)) and not sb._ready._ready
    with pytest.raises(ValueError, match="ready must be"):
        make_sandbox("bubblewrap", ready=-1)


def test_large_code_and_unicode(sb):
    code = "# " + "x" * 300_000 + "\nprint('héllo ✓')"
    r = sb.run(code)
    assert r.stdout == "héllo ✓\n", r.stderr


def test_output_cap_on_a_program_that_finishes(sb):
    r = sb.run("print('A' * 1_000_000)", FAST.replace(max_output_bytes=1000))
    assert r.exit_code == 0 and r.output_truncated and not r.timed_out and not r.ok
    assert r.stdout.startswith("A" * 1000) and "more bytes dropped" in r.stdout and len(r.stdout) < 1200


def test_timeout_kills_the_tree_and_keeps_partial_output(sb):
    r = sb.run("import time, subprocess\nsubprocess.Popen(['/usr/bin/sleep', '77.4242'])\nprint('started')\n"
               "time.sleep(60)", FAST.replace(timeout_s=0.5))
    assert r.timed_out and r.exit_code is None and r.stdout == "started\n"
    assert r.wall_time_s < 0.5 + 1.0
    assert gone_soon(lambda: subprocess.run(["pgrep", "-f", "sleep 77.4242"], capture_output=True).returncode == 0)


def test_each_live_sandbox_gets_its_own_unprivileged_uid(sb):
    with sb.session() as a, sb.session() as b:
        ua, ub = (int(s.run("import os; os.getuid()").stdout) for s in (a, b))
    assert ua != ub and ua >= 1000 and ub >= 1000
    fixed = make_sandbox("bubblewrap", limits=FAST, uid=65534)
    assert fixed.run("import os; print(os.getuid(), os.getgid(), os.getgroups())").stdout == "65534 65534 []\n"


# ---- sessions ------------------------------------------------------------------------------------------------

def test_session_is_a_notebook(sb):
    with sb.session() as s:
        assert s.run("x = 2").stdout == ""
        r = s.run("print(x)")
        assert r.stdout == "2\n" and r.ok and not r.session_restarted
        assert s.run("x * 21").stdout == "42\n"  # a trailing expression echoes its repr
        assert s.run("None").stdout == "" and s.run("'a'").stdout == "'a'\n"
        r = s.run("y = 1\nundefined_name")
        assert r.exit_code == 1 and "NameError" in r.stderr and '<cell-' in r.stderr
        assert s.run("import sys; sys.exit(3)").exit_code == 3  # ends the cell, not the interpreter
        r = s.run("print(x, y)")
        assert r.stdout == "2 1\n" and not r.session_restarted


def test_session_timeout_restarts_fresh_and_says_so(sb):
    with sb.session() as s:
        s.run("x = 1")
        r = s.run("import time; print('before', flush=True); time.sleep(30)", FAST.replace(timeout_s=0.5))
        assert r.timed_out and r.session_restarted and r.stdout == "before\n" and r.wall_time_s < 1.5
        r = s.run("print(x)")
        assert "NameError" in r.stderr and not r.session_restarted  # state is gone, the new one works
        assert s.run("1 + 1").stdout == "2\n" and s.restarts == 1


def test_session_crash_and_memory_error(sb):
    with sb.session() as s:
        s.run("keep = 5")
        r = s.run("blocks = [bytearray(1 << 30) for _ in range(4)]")
        assert r.memory_exceeded and not r.session_restarted and s.run("keep").stdout == "5\n"
        r = s.run("import os; os._exit(3)")
        assert r.session_restarted and r.exit_code == 3 and not r.timed_out
        assert "NameError" in s.run("keep").stderr


def test_session_cpu_limit_is_per_cell(sb):
    with sb.session(FAST.replace(cpu_s=1.0, timeout_s=10.0)) as s:
        s.run("t = sum(range(10**6))")
        r = s.run("while True: pass")
        assert r.cpu_exceeded and r.session_restarted and r.wall_time_s < 10


def test_a_session_cell_that_raises_its_cpu_limit_is_stopped_by_the_host(sb):
    """The runner's soft CPU limit is the cell's to raise (its hard limit must stay open for later cells); the host
    meters the whole tree through its cgroup and ends the call at the CPU budget, long before its wall timeout."""
    with sb.session(FAST.replace(cpu_s=1.0, timeout_s=30.0)) as s:
        s.run("import resource, signal")
        r = s.run("signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                  "resource.setrlimit(resource.RLIMIT_CPU, (1000, resource.RLIM_INFINITY))\n"
                  "print('raised', flush=True)\n"
                  "while True: pass")
        assert r.stdout == "raised\n" and r.cpu_exceeded and r.session_restarted and not r.timed_out
        assert s.run("print(2)").stdout == "2\n"


def test_session_limits_that_are_fixed_at_start(sb):
    with sb.session() as s:
        with pytest.raises(ValueError, match="memory_mb"):
            s.run("1", FAST.replace(memory_mb=1024))
        assert s.run("print(1)", FAST.replace(timeout_s=1.0, max_output_bytes=10)).stdout == "1\n"
    with pytest.raises(RuntimeError, match="closed"):
        s.run("1")


def test_sessions_die_on_close_gc_and_thread_exit(sb):
    s = sb.session()
    uid = int(s.run("import os; os.getuid()").stdout)
    s.close()
    assert gone_soon(lambda: procs_of_uid(uid))

    s = sb.session()
    uid = int(s.run("import os; os.getuid()").stdout)
    del s
    gc.collect()
    assert gone_soon(lambda: procs_of_uid(uid))

    box = {}
    t = threading.Thread(target=lambda: box.update(s=sb.session()))  # the opening thread ends before use
    t.start()
    t.join()
    time.sleep(0.2)
    assert box["s"].run("print('still here')").stdout == "still here\n"
    box["s"].close()


@pytest.mark.parametrize("how", ["exit", "crash"])
def test_no_orphans_when_the_host_exits_or_crashes_mid_call(how):
    mark = f"{os.getpid()}{how == 'crash':d}"
    child = textwrap.dedent(f"""
        import os, subprocess, threading, time
        from agentenv.sandboxes import Limits, make_sandbox
        sb = make_sandbox("bubblewrap", limits=Limits(timeout_s=60, cpu_s=60))
        s = sb.session()
        print(s.run("import os; os.getuid()").stdout.strip(), flush=True)
        hang = "import subprocess, time; subprocess.Popen(['/usr/bin/sleep', '8{{}}.{mark}']); time.sleep(60)"
        threading.Thread(target=s.run, args=(hang.format(8),), daemon=True).start()      # a session mid-cell
        threading.Thread(target=sb.run, args=(hang.format(9),), daemon=True).start()     # a fresh run mid-call
        time.sleep(1.5)
        print(subprocess.run(["pgrep", "-fc", "sleep 8[89].{mark}"], capture_output=True, text=True).stdout, flush=True)
        if {how == "crash"}:
            os.kill(os.getpid(), 9)
    """)
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=30)
    uid, running = map(int, p.stdout.split()[:2])
    assert running == 2, p.stdout + p.stderr  # both sandboxes really were busy when the host went away
    assert gone_soon(lambda: procs_of_uid(uid), timeout=3.0), f"sandbox processes of uid {uid} outlived the host"
    assert gone_soon(lambda: subprocess.run(["pgrep", "-f", f"sleep 8[89].{mark}"]).returncode == 0, timeout=3.0)


# ---- pool and concurrency ------------------------------------------------------------------------------------

def test_pool_hands_out_warm_sessions_and_resets_them():
    with SandboxPool("bubblewrap", size=2, limits=FAST) as pool:
        s = pool.acquire()
        s.run("secret = 'episode-1'")
        pool.release(s)
        with pytest.raises(ValueError):
            pool.release(s)
        seen = []
        for _ in range(2):
            with pool.session(timeout=10) as t:
                seen.append(t.run("'secret' in dir()").stdout)
        assert seen == ["False\n", "False\n"]
        a, b = pool.acquire(), pool.acquire()
        with pytest.raises(TimeoutError):
            pool.acquire(timeout=0.1)
        pool.release(a)
        pool.release(b)


def test_16_parallel_sessions_without_cross_talk(sb):
    errors = []

    def episode(i):
        try:
            with sb.session() as s:
                s.run(f"me = {i}\nlog = []")
                for step in range(5):
                    r = s.run(f"log.append(me * 100 + {step})\nprint(me, sum(log))")
                    want = f"{i} {sum(i * 100 + k for k in range(step + 1))}\n"
                    if r.stdout != want or not r.ok:
                        errors.append((i, step, r.stdout, r.stderr))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(16)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert time.monotonic() - t0 < 30


# ---- backends and CLI ----------------------------------------------------------------------------------------

def test_subprocess_backend_is_explicit_and_warns():
    with pytest.warns(UnsafeSandboxWarning, match="UNSAFE"):
        sb = make_sandbox("subprocess", limits=FAST)
    with sb:
        assert sb.unsafe and sb.run("print(6 * 7)").stdout == "42\n"
        r = sb.run("import time; time.sleep(30)", FAST.replace(timeout_s=0.3))
        assert r.timed_out and r.wall_time_s < 1.5
        with sb.session() as s:
            s.run("a = 1")
            assert s.run("a + 1").stdout == "2\n"
    assert {"bubblewrap", "subprocess"} <= set(available_backends())


def test_cli_run_prints_one_json_object(tmp_path):
    f = tmp_path / "tool.py"
    f.write_text("import sys\nprint('hi')\nsys.exit(4)\n")
    cli = [sys.executable, "-m", "agentenv.sandboxes.cli", "sandbox", "run"]
    p = subprocess.run(cli + ["--timeout", "3", "--memory-mb", "128", str(f)], capture_output=True, text=True)
    out = json.loads(p.stdout)
    assert p.returncode == 0 and out["stdout"] == "hi\n" and out["exit_code"] == 4 and not out["ok"]
    assert {"stderr", "timed_out", "memory_exceeded", "output_truncated", "wall_time_s"} <= set(out)
    p = subprocess.run(cli + [str(tmp_path / "missing.py")], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == "" and "cannot read" in p.stderr
    p = subprocess.run(cli + ["--timeout", "-1", str(f)], capture_output=True, text=True)
    assert p.returncode == 2 and "timeout_s" in p.stderr

