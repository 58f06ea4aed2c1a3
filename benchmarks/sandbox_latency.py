"""Per-call latency of sandboxed Python: p50/p95 over N calls for each way of running a trivial cell.

    python benchmarks/sandbox_latency.py [--n 200]

Rows: a fresh bubblewrap sandbox per call; a warm bubblewrap session call; the unsandboxed references (the
simplest possible warm interpreter over pipes, and a plain ``python3 -S -I -c pass`` subprocess); and the
``subprocess`` backend (our protocol, no isolation), which separates protocol cost from isolation cost.
Targets (issue 3): warm-session p50 <= 2x the unsandboxed warm interpreter; fresh bubblewrap p50 <= 25 ms.
The machine may be shared: the load average is printed with the figures.
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings

from agentenv.sandboxes import Limits, make_sandbox

CELL = "x = 1"
# The reference warm interpreter: read a length-prefixed cell, exec it, acknowledge. No capture, limits or timeout.
REFERENCE = ("import sys\nr, w, g = sys.stdin.buffer, sys.stdout.buffer, {}\nwhile n := r.readline():\n"
             "    exec(r.read(int(n)), g)\n    w.write(b'ok\\n')\n    w.flush()\n")


def measure(call, n: int, warmup: int = 5) -> tuple[list[float], float]:
    """Wall time per call, and CPU seconds per call spent by this process plus its reaped children."""
    for _ in range(warmup):
        check(call())
    cpu0 = _cpu()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        r = call()
        times.append(time.perf_counter() - t)
        check(r)
    return times, (_cpu() - cpu0) / n


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def check(r) -> None:
    if hasattr(r, "ok") and not r.ok:
        raise SystemExit(f"benchmark call failed: {r}")


def row(name: str, measured: tuple[list[float], float]) -> float:
    times, cpu = measured
    q = statistics.quantiles(times, n=20)
    p50, p95 = statistics.median(times) * 1e3, q[18] * 1e3
    print(f"{name:48s} p50 {p50:8.3f} ms  p95 {p95:8.3f} ms  cpu {cpu * 1e3:7.3f} ms/call  (n={len(times)})",
          flush=True)
    return p50


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="calls per row (>= 200 for the issue's figures)")
    args = ap.parse_args(argv)
    limits = Limits(timeout_s=10, cpu_s=10)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; cell {CELL!r}")
    bw = make_sandbox("bubblewrap", limits=limits)
    fresh = row("bubblewrap fresh process per call", measure(lambda: bw.run(CELL), args.n))
    with bw.session() as s:
        warm = row("bubblewrap warm session call", measure(lambda: s.run(CELL), args.n))

    ref = subprocess.Popen(["/usr/bin/python3", "-S", "-I", "-c", REFERENCE], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)
    body = CELL.encode()

    def ref_call():
        ref.stdin.write(b"%d\n" % len(body) + body)
        ref.stdin.flush()
        return ref.stdout.readline()

    reference = row("unsandboxed warm interpreter (reference)", measure(ref_call, args.n))
    ref.stdin.close()
    ref.wait()
    row("plain subprocess python3 -S -I -c (reference)",
        measure(lambda: subprocess.run(["/usr/bin/python3", "-S", "-I", "-c", CELL]), args.n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unsafe = make_sandbox("subprocess", limits=limits)
    with unsafe:
        row("subprocess backend fresh (our runner, no isolation)", measure(lambda: unsafe.run(CELL), args.n))
        with unsafe.session() as s:
            same = row("subprocess backend warm session (no isolation)", measure(lambda: s.run(CELL), args.n))
    ok_warm, ok_fresh = warm <= 2 * reference, fresh <= 25.0
    print(f"warm bubblewrap session / bare warm interpreter loop   = {warm / reference:.2f}x (target <= 2x): "
          f"{'PASS' if ok_warm else 'FAIL'}")
    print(f"warm bubblewrap session / unsandboxed session (same protocol) = {warm / same:.2f}x (isolation's share)")
    print(f"fresh bubblewrap p50 = {fresh:.1f} ms (target <= 25 ms): {'PASS' if ok_fresh else 'FAIL'}")
    return 0 if ok_warm and ok_fresh else 1


if __name__ == "__main__":
    sys.exit(main())
