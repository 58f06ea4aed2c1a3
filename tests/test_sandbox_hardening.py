"""The kernel layers under the bubblewrap backend: a cgroup per sandbox, the seccomp filter, never-reused uids,
and rlimits that never try to exceed a hard limit. Every check runs real sandboxed processes; where a layer is
what stops an attack, the same code is also run with that layer off to show the test can fail."""

import ctypes
import errno
import os
import shutil
import subprocess
import sys
import time
import warnings

import pytest

from agentenv.sandboxes import Limits, cgroups, make_sandbox, seccomp_filter
from agentenv.sandboxes.bubblewrap import UID_BASE, UID_SPAN, _UidAllocator

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (apt-get install -y bubblewrap)")
LIM = Limits(timeout_s=10, cpu_s=10, memory_mb=128, max_processes=8, max_file_mb=8, disk_mb=16)
MEMFD_BOMB = """
import os
held = []
for i in range(60):  # 60 x 7 MB = 420 MB of shared memory under a 128 MB limit; no address space used
    fd = os.memfd_create("m%d" % i)
    os.posix_fallocate(fd, 0, 7 << 20)
    held.append(fd)
print("held", len(held) * 7, "MB")
"""


def _need_cgroups():
    if cgroups.manager() is None:
        pytest.skip(f"cgroups cannot be delegated here: {cgroups.UNAVAILABLE}")


def _need_seccomp():
    if seccomp_filter.bpf() is None:
        pytest.skip(f"no libseccomp binding: {seccomp_filter.UNAVAILABLE}")


def _quiet(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return make_sandbox("bubblewrap", limits=LIM, **kwargs)


# ---- cgroups -------------------------------------------------------------------------------------------------

def test_each_tree_gets_its_own_limited_cgroup_that_is_removed_after():
    _need_cgroups()
    sb = make_sandbox("bubblewrap", limits=LIM, cpus=0.5)
    with sb.session() as s:
        assert s.run("1 + 1").stdout == "2\n"
        group = s._proc.cgroup
        host_pids = group.pids()
        assert s._proc.pid in host_pids and len(host_pids) == cgroups.REST_TASKS  # bwrap, its init, the python
        if group.v2:
            d = group.dirs["memory"]
            assert (d / "memory.max").read_text().strip() == str(128 << 20)
            assert (d / "pids.max").read_text().strip() == str(8 + cgroups.EXTRA_PIDS)
            assert (d / "cpu.max").read_text().split() == ["50000", "100000"]
        else:
            assert int((group.dirs["memory"] / "memory.limit_in_bytes").read_text()) == 128 << 20
            memsw = group.dirs["memory"] / "memory.memsw.limit_in_bytes"
            assert not memsw.exists() or int(memsw.read_text()) == 128 << 20  # no swap on top
            assert (group.dirs["pids"] / "pids.max").read_text().strip() == str(8 + cgroups.EXTRA_PIDS)
            assert int((group.dirs["cpu"] / "cpu.cfs_quota_us").read_text()) == 50_000
    dirs = list(group.dirs.values())
    end = time.monotonic() + 3
    while any(d.exists() for d in dirs) and time.monotonic() < end:
        cgroups.manager()._retry_pending()
        time.sleep(0.05)
    assert not any(d.exists() for d in dirs)


def test_shared_memory_is_counted_and_reported_as_memory_exceeded():
    _need_cgroups()
    r = _quiet().run(MEMFD_BOMB)
    assert r.memory_exceeded and r.exit_code == 128 + 9 and not r.ok and "held" not in r.stdout, r
    r = _quiet(cgroups=False).run(MEMFD_BOMB)  # rlimits alone: the bypass the cgroup closes
    assert r.stdout == "held 420 MB\n" and r.ok, r


def test_oom_in_a_session_restarts_it_and_is_reported_once():
    _need_cgroups()
    with _quiet().session() as s:
        s.run("x = 1")
        r = s.run(MEMFD_BOMB)
        assert r.memory_exceeded and r.session_restarted
        r = s.run("print('fresh')")
        assert r.ok and not r.memory_exceeded and r.stdout == "fresh\n"


def _cpu_seconds(pids) -> float:
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime + stime, all threads
    return total / os.sysconf("SC_CLK_TCK")


SPINNER = """
import signal, threading
signal.signal(signal.SIGXCPU, signal.SIG_IGN)
def spin():
    while True:
        pass
threading.Thread(target=spin, daemon=True).start()
"""


def test_a_thread_left_spinning_gets_no_cpu_between_cells():
    _need_cgroups()
    with _quiet().session() as s:
        assert s.run(SPINNER).ok
        pids = s._proc.cgroup.pids()
        before = _cpu_seconds(pids)
        time.sleep(1.0)
        idle = _cpu_seconds(pids) - before
        assert idle < 0.1, f"the tree used {idle:.2f} s of CPU while no cell ran"
        assert s.run("threading.active_count()").stdout == "2\n"  # thawed: the state and the thread are kept
    with _quiet(cgroups=False).session() as s:  # without the freezer the same thread burns CPU between cells
        assert s.run(SPINNER).ok
        pid = s._proc.pid
        pids = [pid, *(int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True,
                                                      text=True).stdout.split())]
        pids += [int(p) for q in pids[1:] for p in subprocess.run(["pgrep", "-P", str(q)], capture_output=True,
                                                                 text=True).stdout.split()]
        before = _cpu_seconds(pids)
        time.sleep(1.5)
        assert _cpu_seconds(pids) - before > 0.1  # a loaded 2-core host still gives a spinner far more than this


def test_without_delegable_cgroups_it_warns_loudly_and_still_runs():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to make the cgroup filesystem read-only in a private mount namespace")
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from agentenv.sandboxes import make_sandbox\n"
            "print(make_sandbox('bubblewrap').run('print(6 * 7)').stdout, end='')\n"
            "try:\n    make_sandbox('bubblewrap', cgroups=True)\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    script = ("for m in $(awk '$3 ~ /^cgroup/ {print $2}' /proc/self/mounts); do mount -o remount,bind,ro $m; done; "
              f"exec {sys.executable} -c \"$0\"")
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, code],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("42\nrefused: bubblewrap backend: running WITHOUT cgroups"), p.stdout
    assert "WITHOUT cgroups" in p.stderr and "Read-only file system" in p.stderr


# ---- seccomp and namespaces ------------------------------------------------------------------------------------

PROBE = """
import ctypes, errno, os, platform
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": dict(unshare=272, keyctl=250, add_key=248, bpf=321, perf_event_open=298, userfaultfd=323,
                     ptrace=101, clone3=435, setns=308, mount=165, kexec_load=246, init_module=175,
                     personality=135),
      "aarch64": dict(unshare=97, keyctl=219, add_key=217, bpf=280, perf_event_open=241, userfaultfd=282,
                      ptrace=117, clone3=435, setns=268, mount=40, kexec_load=104, init_module=105,
                      personality=92)}[platform.machine()]
args = dict(unshare=(0x10000000,), keyctl=(0, -4, 0), add_key=(b"user", b"k", b"v", 1, -4), bpf=(0, 0, 0),
            perf_event_open=(0, 0, -1, -1, 0), userfaultfd=(0,), ptrace=(16, 1, 0, 0), clone3=(0, 0),
            setns=(-1, 0), mount=(b"none", b"/tmp", b"tmpfs", 0, 0), kexec_load=(0, 0, 0, 0),
            init_module=(0, 0, b""), personality=(0x0040000,))
for name, nr in NR.items():
    r = libc.syscall(nr, *args[name])
    print(name, errno.errorcode.get(ctypes.get_errno(), "?") if r == -1 else "OK")
"""


def test_seccomp_denies_what_tool_code_never_needs():
    _need_seccomp()
    r = _quiet().run(PROBE)
    got = dict(line.split() for line in r.stdout.splitlines())
    assert got.pop("clone3") == "ENOSYS"  # libc then falls back to clone(), whose flags the filter can check
    assert set(got.values()) == {"EPERM"}, got
    off = dict(line.split() for line in _quiet(seccomp=False).run(PROBE).stdout.splitlines())
    assert off["unshare"] == "OK" and off["keyctl"] != "EPERM" and off["personality"] == "OK", off


def test_ordinary_python_still_works_under_the_filter():
    _need_seccomp()
    code = ("import subprocess, threading, concurrent.futures, socket, os, time\n"
            "t = threading.Thread(target=time.sleep, args=(0.01,)); t.start(); t.join()\n"
            "a, b = socket.socketpair(); a.send(b'x'); assert b.recv(1) == b'x'\n"
            "print(subprocess.run(['/usr/bin/echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
            "with concurrent.futures.ThreadPoolExecutor(2) as p: print(sum(p.map(abs, [-1, -2])))\n"
            "pid = os.fork()\nif pid == 0: os._exit(7)\nprint(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    r = _quiet().run(code)
    assert r.stdout == "child\n3\n7\n" and r.ok, r


def test_one_sandbox_cannot_lock_shared_usr_files_against_another():
    """Two live sandboxes see the same /usr inodes: the first one's lock attempts must leave the second (and the
    host) able to take an exclusive lock; POSIX locks on its own files still work (sqlite)."""
    _need_seccomp()
    import fcntl
    hold = ("import fcntl, os, sys\nfd = os.open(os.path.realpath(sys.executable), os.O_RDONLY)\n"
            "for take in (lambda: fcntl.flock(fd, fcntl.LOCK_EX), lambda: fcntl.lockf(fd, fcntl.LOCK_SH)):\n"
            "    try:\n        take()\n        print('held')\n    except OSError as e:\n"
            "        print('refused', e.errno)\n")
    probe = ("import fcntl, os, sys\nfd = os.open(os.path.realpath(sys.executable), os.O_RDONLY)\n"
             "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n    print('free')\n"
             "except OSError as e:\n    print('blocked', e.errno)\n")
    sb = _quiet()
    with sb.session() as a, sb.session() as b:
        assert a.run(hold).stdout.split() == ["refused", str(errno.ENOLCK), "held"]  # flock denied; a shared lockf
        assert b.run(probe).stdout.split() == ["blocked", str(errno.ENOLCK)]  # not by a, by the filter
        with open(os.path.realpath("/usr/bin/python3"), "rb") as f:  # the host: nothing holds it
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
        r = b.run("import sqlite3\ndb = sqlite3.connect('/tmp/x.db')\ndb.execute('create table t (x)')\n"
                  "db.execute('insert into t values (1)')\ndb.commit()\nprint(db.execute('select x from t').fetchall())")
        assert r.stdout == "[(1,)]\n", r.stderr


def test_the_filter_is_a_real_bpf_program():
    _need_seccomp()
    prog = seccomp_filter.bpf()
    assert prog and len(prog) % 8 == 0 and len(prog) > 8 * len(seccomp_filter.DENY)


def test_uids_are_never_handed_out_twice():
    alloc = _UidAllocator(UID_BASE, UID_SPAN)
    uids = [alloc.take() for _ in range(20_000)]
    assert len(set(uids)) == len(uids) and all(UID_BASE <= u < UID_BASE + UID_SPAN for u in uids)


# ---- rlimits ------------------------------------------------------------------------------------------------

def test_runner_never_raises_a_limit_above_its_hard_limit():
    """Docker's bug: RLIMIT_NPROC above the container's hard limit raised ValueError before any code ran."""
    code = ("import resource, warnings\nwarnings.simplefilter('ignore')\n"
            "resource.setrlimit(resource.RLIMIT_NPROC, (500, 500))\n"
            "from agentenv.sandboxes import Limits, make_sandbox\n"
            "r = make_sandbox('subprocess', limits=Limits(max_processes=1 << 20, max_open_files=1 << 30)).run("
            "'import resource as r; print(r.getrlimit(r.RLIMIT_NPROC), r.getrlimit(r.RLIMIT_NOFILE)[0] <= 1 << 20)')\n"
            "print(r.stdout + r.stderr, end='')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout == "(500, 500) True\n", p.stdout + p.stderr


def test_open_files_are_capped():
    r = _quiet().run("import os\nn = 0\ntry:\n    while True:\n        os.open('/dev/null', 0); n += 1\n"
                     "except OSError as e:\n    print(n < 64, e.strerror)", LIM.replace(max_open_files=64))
    assert r.stdout == "True Too many open files\n", r


def test_groups_of_a_host_that_died_are_removed_by_the_next_one():
    _need_cgroups()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [p.parent / f"agentenv-{dead.pid}" for p in cgroups.manager().parents.values()]
    for d in stale:
        (d / "sb-0").mkdir(parents=True)
    p = subprocess.run([sys.executable, "-c", "from agentenv.sandboxes import cgroups; assert cgroups.manager()"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert not any(d.exists() for d in stale)


def test_cgroup_paths_are_found_on_v1_and_v2_hosts():
    """Where each controller's groups go, from a host's mountinfo and /proc/self/cgroup (v2 cannot run here)."""
    v2_mounts = ("29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
                 "30 23 0:27 / /proc rw - proc proc rw\n")
    own = cgroups._own_paths("0::/user.slice/user-1000.slice/app.scope\n")
    v1, v2 = cgroups._mounts(v2_mounts)
    assert v1 == {} and v2 == ("/sys/fs/cgroup", "/")
    assert str(cgroups._under(v2, own[""])) == "/sys/fs/cgroup/user.slice/user-1000.slice/app.scope"
    v1_mounts = ("32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
                 "35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                 "38 31 0:35 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n")
    own = cgroups._own_paths("4:memory:/docker/abc/job\n8:pids:/\n1:cpu,cpuacct:/x\n")
    v1, v2 = cgroups._mounts(v1_mounts)
    assert v2 is None and set(v1) == {"cpu", "memory", "pids"} and own["cpuacct"] == "/x"
    assert str(cgroups._under(v1["memory"], own["memory"])) == "/sys/fs/cgroup/memory/job"  # mount root stripped
    assert str(cgroups._under(v1["cpu"], own["cpu"])) == "/sys/fs/cgroup/cpu/x"


def test_a_groups_cpu_is_metered_on_v1_and_v2(tmp_path):
    """The CPU meter that bounds a call's CPU from outside: a live v1 group here, and a v2 group's files."""
    _need_cgroups()
    m = cgroups.manager()
    g = m.create(64 << 20, 8, 1.0)
    try:
        if not g.meters_cpu:
            pytest.skip("this v1 host mounts no cpuacct controller")
        subprocess.run(g.join_argv(["/usr/bin/python3", "-S", "-I", "-c", "sum(range(3 * 10**6))"]), check=True)
        assert g.cpu_seconds() > 0.01
    finally:
        g.destroy()
    for name, text in (("memory.events", "oom_kill 0\n"), ("pids.current", "1\n"),
                       ("cpu.stat", "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")):
        (tmp_path / name).write_text(text)
    v2 = cgroups.Cgroup(cgroups.CgroupManager(2, {}), {"memory": tmp_path})
    assert v2.meters_cpu and v2.cpu_seconds() == 2.5
    v2.release()
