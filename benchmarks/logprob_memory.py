"""Peak memory and time: chunked sampled-token log-probs vs the naive full log-softmax, at vocab 151,665.

Each measurement runs in a fresh subprocess (so peaks do not mix) and reports the growth of the process's peak RSS
(``resource.getrusage``) over its value just before the measured forward + backward, i.e. the extra memory the
log-prob computation needs on top of its inputs. A naive run whose estimate exceeds ``--naive-budget-gb`` is not run
(it would be OOM-killed on a shared 24 GB machine); its peak is then projected from the largest naive run measured.
Finally one full :class:`~agentenv.trainer.Learner` update on the built-in tiny model is timed.

    python benchmarks/logprob_memory.py                      # 1k, 4k, 16k tokens, hidden 64
    python benchmarks/logprob_memory.py --tokens 1024 4096 --hidden 896 --chunk 1024
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

VOCAB = 151_665


def worker(method: str, n: int, hidden: int, chunk: int) -> dict:
    import resource

    import torch

    from agentenv.trainer.logprobs import chunked_log_probs, naive_log_probs

    torch.manual_seed(0)
    h = torch.randn(n, hidden, requires_grad=True)
    w = (0.05 * torch.randn(VOCAB, hidden)).requires_grad_()
    targets = torch.randint(0, VOCAB, (n,))
    # warm up allocator / kernels on a small slice so the timed run measures steady-state work
    chunked_log_probs(h[:8], w, targets[:8], chunk_size=chunk)[0].sum().backward()
    h.grad = w.grad = None
    w.grad = torch.zeros_like(w)  # gradient buffers exist in training anyway: not counted as extra
    h.grad = torch.zeros_like(h)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    if method == "chunked":
        lp, _ = chunked_log_probs(h, w, targets, chunk_size=chunk)
    else:
        lp, _ = naive_log_probs(h, w, targets)
    lp.sum().backward()
    elapsed = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"method": method, "tokens": n, "extra_peak_gb": (peak - base) / 2**20, "time_s": elapsed}


def run_worker(method: str, n: int, hidden: int, chunk: int) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", method, str(n), "--hidden", str(hidden), "--chunk", str(chunk)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  {method} at {n} tokens failed (rc {proc.returncode}): {proc.stderr.strip()[-300:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def full_update(batch_size: int, seq_len: int) -> None:
    import random

    import torch

    from agentenv.samplers.tiny import TinyConfig, tiny_model
    from agentenv.core.trajectory import Trajectory
    from agentenv.trainer import Learner, LearnerConfig

    rng = random.Random(0)
    model = tiny_model(TinyConfig())
    trajs = []
    for i in range(batch_size):
        n = rng.randint(seq_len // 2, seq_len)
        mask = [False] * 16 + [rng.random() < 0.7 for _ in range(n - 16)]
        trajs.append(Trajectory(
            token_ids=[rng.randrange(VOCAB) for _ in range(n)], action_mask=mask,
            behavior_logprobs=[-11.9 - 0.05 * rng.random() if m else 0.0 for m in mask],  # ~ log(1/V): near on-policy
            policy_version=[0 if m else -1 for m in mask], reward=float(i % 2), success=bool(i % 2), id=f"bench-{i}"))
    learner = Learner(model, LearnerConfig(compute_entropy=True, max_tokens_per_microbatch=4 * seq_len))
    t0 = time.perf_counter()
    stats = learner.update(trajs)
    wall = time.perf_counter() - t0
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    params = sum(p.numel() for p in model.parameters())
    print(f"\nOne Learner.update on the tiny model ({params / 1e6:.1f}M params, vocab {VOCAB}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads): {batch_size} trajectories, "
          f"{stats['policy_tokens']} policy tokens, {stats['num_microbatches']} micro-batches")
    print(f"  wall {wall:.2f}s, process peak RSS {peak:.2f} GB")
    keys = ("loss", "acceptance_rate", "seq_kl_mean", "seq_kl_max", "ratio_mean", "ratio_min", "ratio_max",
            "entropy_mean", "grad_norm", "lr", "step", "policy_version", "retained_tokens")
    print("  " + ", ".join(f"{k}={stats[k]:.4g}" if isinstance(stats[k], float) else f"{k}={stats[k]}" for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--naive-budget-gb", type=float, default=12.0)
    ap.add_argument("--update-batch", type=int, default=8)
    ap.add_argument("--update-seq-len", type=int, default=512)
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.hidden, args.chunk)))
        return

    print(f"Sampled-token log-probs, forward + backward, vocab {VOCAB}, hidden {args.hidden}, chunk {args.chunk}; "
          f"extra peak RSS over inputs + grad buffers")
    print(f"{'tokens':>7} | {'naive GB':>9} {'naive s':>8} | {'chunked GB':>10} {'chunked s':>9} | "
          f"{'mem ratio':>9} {'time ratio':>10}")
    last_naive = None
    for n in args.tokens:
        chunked = run_worker("chunked", n, args.hidden, args.chunk)
        estimate = 4 * n * VOCAB * 4 / 2**30  # logits, log-softmax, and their grads, float32
        naive = run_worker("naive", n, args.hidden, args.chunk) if estimate <= args.naive_budget_gb else None
        if naive is not None:
            last_naive = naive
            nv_gb, nv_s, note = f"{naive['extra_peak_gb']:9.2f}", f"{naive['time_s']:8.2f}", ""
            ratio_m = naive["extra_peak_gb"] / max(chunked["extra_peak_gb"], 1e-3)
            ratio_t = naive["time_s"] / chunked["time_s"]
            ratios = f"{ratio_m:8.1f}x {ratio_t:9.2f}x"
        else:
            proj = last_naive["extra_peak_gb"] * n / last_naive["tokens"] if last_naive else estimate
            nv_gb, nv_s, note = f"~{proj:8.1f}", f"{'skipped':>8}", " (naive not run: projected)"
            ratios = f"~{proj / max(chunked['extra_peak_gb'], 1e-3):7.1f}x {'-':>10}"
        print(f"{n:>7} | {nv_gb} {nv_s} | {chunked['extra_peak_gb']:10.2f} {chunked['time_s']:9.2f} | {ratios}{note}")
    full_update(args.update_batch, args.update_seq_len)


if __name__ == "__main__":
    main()
