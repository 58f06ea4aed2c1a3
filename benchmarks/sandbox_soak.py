"""Soak test of the sandbox pool: many real PythonToolEnv episodes in flight for minutes, hostile cells mixed in;
does anything leak or slow down?

    python benchmarks/sandbox_soak.py [--minutes 10] [--in-flight 64] [--pool 16] [--hostile 0.1]

``--in-flight`` threads each own a :class:`~agentenv.envs.python_tool.PythonToolEnv` sharing one
:class:`SandboxPool` and run episodes back to back: ``reset``, 3 to 6 assistant turns that each call the
``python`` tool (arithmetic, a list, a dict, an import) through ``env.step`` -- the episode takes a warm session
from the pool at its first call -- then a final answer, which ends the episode and hands the session back. A share
``--hostile`` of the cells is drawn from :data:`HOSTILE` (a forged end-of-cell marker, a timer signal handler, a
spinning thread, a fork bomb, a memory bomb, a sleep past the timeout, a child that outlives its cell), each
bounded by the call's limits. Every ``--every`` seconds it prints the p50/p99 latency of benign tool turns
(``env.step``) in that interval; at the start and the end the host's process count, sandbox cgroups, this
process's open fds and RSS, /tmp entries and MemAvailable. Exit status 1 if any count grew after the pool was
closed (a leak), else 0. Benign cells must succeed (no tool error); a failed benign cell is counted and printed.
"""

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

from agentenv.envs.python_tool import PythonToolEnv
from agentenv.sandboxes import Limits, SandboxPool, cgroups

BENIGN = ["x = sum(i * i for i in range(2000))", "xs = [str(i) for i in range(500)]; len(xs)",
          "d = {i: i % 7 for i in range(300)}; sum(d.values())", "import json; json.dumps({'a': [1, 2, 3]})"]
HOSTILE = {
    "forged_marker": "import os, sys; os.write(1, b'\\0\\x1eAE' + sys._getframe(1).f_locals['nonce'] + "
                     "b':0:\\0')\nimport time\nend = time.monotonic() + 0.3\nwhile time.monotonic() < end: pass",
    "timer_handler": "import signal\nsignal.signal(signal.SIGALRM, lambda *a: sum(range(10000)))\n"
                     "signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)",
    "spinning_thread": "import threading\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True).start()",
    "fork_bomb": "import os\nfor _ in range(64):\n    try:\n        os.fork()\n    except OSError:\n        break",
    "memory_bomb": "b = bytearray(1 << 31)",
    "sleep_past_timeout": "import time; time.sleep(60)",
    "orphan_child": "import subprocess; subprocess.Popen(['/usr/bin/sleep', '30'])",
}
LIMITS = Limits(timeout_s=2.0, cpu_s=2.0, memory_mb=256, max_processes=16)


def counts() -> dict:
    m = cgroups.manager()
    groups = sum(len(list(p.glob("sb-*"))) for p in dict.fromkeys(m.parents.values())) if m else 0
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return {"processes": sum(d.isdigit() for d in os.listdir("/proc")), "cgroups": groups,
            "host_fds": len(os.listdir("/proc/self/fd")), "tmp_entries": len(os.listdir("/tmp")),
            "host_rss_mb": rss >> 10, "mem_available_mb": avail >> 10}


def call(code: str) -> str:
    """One assistant turn that calls the python tool (the Hermes format the env parses)."""
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


class Soak:
    def __init__(self, pool: SandboxPool, hostile: float, stop_at: float):
        self.pool, self.hostile, self.stop_at = pool, hostile, stop_at
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.stats = {"episodes": 0, "benign": 0, "benign_failed": 0, "hostile": 0}

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        env = PythonToolEnv(pool=self.pool, num_tasks=16, task_seed=seed, max_turns=8)
        try:
            while time.monotonic() < self.stop_at:
                env.reset(seed=rng.randrange(1 << 30))
                for _ in range(rng.randint(3, 6)):
                    hostile = rng.random() < self.hostile
                    code = HOSTILE[rng.choice(sorted(HOSTILE))] if hostile else rng.choice(BENIGN)
                    t = time.perf_counter()
                    _, _, done, _, info = env.step(call(code))
                    if hostile:
                        self._count("hostile")
                    else:
                        with self.lock:
                            self.latencies.append(time.perf_counter() - t)
                        self._count("benign_failed" if info.get("tool_errors") else "benign")
                        if info.get("tool_errors"):
                            print("benign cell failed:", code, flush=True)
                    if done:
                        break
                else:
                    env.step("The answer is \\boxed{0}.")
                self._count("episodes")
        finally:
            env.close()

    def _count(self, key: str) -> None:
        with self.lock:
            self.stats[key] += 1

    def take_latencies(self) -> list[float]:
        with self.lock:
            out, self.latencies = self.latencies, []
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--in-flight", type=int, default=64, help="episodes running at once")
    ap.add_argument("--pool", type=int, default=16, help="warm sessions in the pool")
    ap.add_argument("--hostile", type=float, default=0.1, help="share of hostile cells")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between latency lines")
    args = ap.parse_args(argv)
    if not (args.minutes > 0 and args.in_flight > 0 and args.pool > 0 and 0 <= args.hostile <= 1):
        ap.error("--minutes, --in-flight and --pool must be positive and --hostile within [0, 1]")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus (a shared machine skews latency)")
    before = counts()
    start = time.monotonic()
    pool = SandboxPool("bubblewrap", size=args.pool, limits=LIMITS)
    soak = Soak(pool, args.hostile, start + args.minutes * 60)
    threads = [threading.Thread(target=soak.worker, args=(i,), daemon=True) for i in range(args.in_flight)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(args.every)
        lat = sorted(soak.take_latencies())
        if len(lat) >= 2:
            p99 = statistics.quantiles(lat, n=100)[98]
            print(f"t={time.monotonic() - start:6.0f}s  benign turns {len(lat):5d}  p50 {statistics.median(lat) * 1e3:7.2f} ms"
                  f"  p99 {p99 * 1e3:8.2f} ms  {soak.stats}", flush=True)
    pool.close()
    time.sleep(2.0)  # killed trees leave the process table and their cgroups are removed
    after = counts()
    print("before:", before)
    print("after: ", after)
    leaks = {k: after[k] - before[k] for k in ("processes", "cgroups", "host_fds", "tmp_entries")
             if after[k] > before[k] + (0 if k == "cgroups" else 2)}  # +2: the machine is shared
    print("leaks:", leaks or "none", "| failed benign cells:", soak.stats["benign_failed"])
    return 1 if leaks else 0


if __name__ == "__main__":
    sys.exit(main())
