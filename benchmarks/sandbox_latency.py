"""Per-call latency of sandboxed Python: p50/p95 over N calls for each way of running a trivial cell.

    python benchmarks/sandbox_latency.py [--n 200]

Rows: a fresh bubblewrap sandbox per call, taken from the sandbox's ready queue (sandboxes/ready.py) with
``--gap-ms`` of idle time before each call (as between a model's tool calls: the queue refills meanwhile), then
back to back (the queue drained: start throughput bounds it), then started at the call (``ready=0``); a warm
bubblewrap session call; the unsandboxed references (the
simplest possible warm interpreter over pipes, and a plain ``python3 -S -I -c pass`` subprocess); and the
``subprocess`` backend (our protocol, no isolation), which separates protocol cost from isolation cost.
Targets (issues 13, 43): fresh bubblewrap p50 <= 20 ms and p95 <= 25 ms, warm-session p50 <= 0.2 ms (the
end-of-cell check, and a freeze where one is needed, included), with every hardening layer on
(a cgroup per sandbox, the seccomp filter); ratios are printed against a plain ``python3 -S -I -c`` subprocess
and the bare warm interpreter. A row with the layers off shows what they cost. The machine may be shared: the load
average is printed with the figures.
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


def measure(call, n: int, warmup: int = 5, gap_s: float = 0.0) -> tuple[list[float], float]:
    """Wall time per call, and CPU seconds per call spent by this process plus its reaped children. ``gap_s``:
    untimed idle time before each call (an agent's tool calls come between generations, not back to back)."""
    for _ in range(warmup):
        check(call())
    cpu0 = _cpu()
    times = []
    for _ in range(n):
        time.sleep(gap_s)
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


def row(name: str, measured: tuple[list[float], float]) -> tuple[float, float]:
    times, cpu = measured
    q = statistics.quantiles(times, n=20)
    p50, p95 = statistics.median(times) * 1e3, q[18] * 1e3
    print(f"{name:48s} p50 {p50:8.3f} ms  p95 {p95:8.3f} ms  cpu {cpu * 1e3:7.3f} ms/call  (n={len(times)})",
          flush=True)
    return p50, p95


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="calls per row (>= 200 for the issue's figures)")
    ap.add_argument("--gap-ms", type=float, default=50.0,
                    help="idle time before each call of the main fresh row (a model generates between tool calls)")
    args = ap.parse_args(argv)
    limits = Limits(timeout_s=10, cpu_s=10)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus; cell {CELL!r}")
    bw = make_sandbox("bubblewrap", limits=limits)
    from agentenv.sandboxes import cgroups, seccomp_filter
    print(f"layers: cgroups {'v%d' % bw.cgroups.version if bw.cgroups else 'OFF (' + str(cgroups.UNAVAILABLE) + ')'}, "
          f"seccomp {'on' if bw.seccomp else 'OFF (' + str(seccomp_filter.UNAVAILABLE) + ')'}")
    fresh, fresh95 = row(f"bubblewrap fresh (ready queue, {args.gap_ms:.0f} ms between calls)",
                         measure(lambda: bw.run(CELL), args.n, gap_s=args.gap_ms / 1e3))
    row("bubblewrap fresh (ready queue, back to back)", measure(lambda: bw.run(CELL), args.n))
    with bw.session() as s:
        warm, warm95 = row("bubblewrap warm session call", measure(lambda: s.run(CELL), args.n))
    bw.close()
    cold = make_sandbox("bubblewrap", limits=limits, ready=0)
    row("bubblewrap fresh, started at the call (ready=0)", measure(lambda: cold.run(CELL), args.n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bare = make_sandbox("bubblewrap", limits=limits, cgroups=False, seccomp=False, ready=0)
    row("bubblewrap fresh at the call, no cgroup / seccomp", measure(lambda: bare.run(CELL), args.n))

    ref = subprocess.Popen(["/usr/bin/python3", "-S", "-I", "-c", REFERENCE], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE)
    body = CELL.encode()

    def ref_call():
        ref.stdin.write(b"%d\n" % len(body) + body)
        ref.stdin.flush()
        return ref.stdout.readline()

    reference, _ = row("unsandboxed warm interpreter (reference)", measure(ref_call, args.n))
    ref.stdin.close()
    ref.wait()
    plain, plain95 = row("plain subprocess python3 -S -I -c (reference)",
                measure(lambda: subprocess.run(["/usr/bin/python3", "-S", "-I", "-c", CELL]), args.n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unsafe = make_sandbox("subprocess", limits=limits)
    with unsafe:
        row("subprocess backend fresh (our runner, no isolation)", measure(lambda: unsafe.run(CELL), args.n))
        with unsafe.session() as s:
            same, _ = row("subprocess backend warm session (no isolation)", measure(lambda: s.run(CELL), args.n))
    ok_warm, ok_fresh = warm <= 0.2, fresh <= 20.0 and fresh95 <= 25.0
    print(f"\n| (load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus) | p50 ms | p95 ms | p50 / plain | "
          "p95 / plain |\n| --- | --- | --- | --- | --- |")
    for name, a, b in (("fresh bubblewrap (every layer on)", fresh, fresh95), ("warm session call", warm, warm95),
                       ("plain python3 -S -I -c", plain, plain95)):
        print(f"| {name} | {a:.3f} | {b:.3f} | {a / plain:.3f} | {b / plain95:.3f} |")
    print(f"\nfresh bubblewrap p50 = {fresh:.1f} ms, p95 = {fresh95:.1f} ms (target p50 <= 20 ms, p95 <= 25 ms): "
          f"{'PASS' if ok_fresh else 'FAIL'}")
    print(f"warm bubblewrap session p50 = {warm:.3f} ms = {warm / reference:.2f}x the bare warm interpreter loop "
          f"(target <= 0.2 ms): {'PASS' if ok_warm else 'FAIL'}")
    print(f"warm bubblewrap session / unsandboxed session (same protocol) = {warm / same:.2f}x (isolation's share)")
    return 0 if ok_warm and ok_fresh else 1


if __name__ == "__main__":
    sys.exit(main())
