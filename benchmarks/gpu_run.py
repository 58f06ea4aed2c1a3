"""GPU check: the real ``agentenv run`` colocated on ONE GPU (vLLM sampler + learner) with a Qwen2.5-1.5B-shaped model.

Prepared for a GPU machine; it has not been run from this repository yet (no GPU has been lent to this project):
its figures belong in ``docs/gpu_results.md``, dated, with the device, once it has run.

It measures something real only if the weights really change and the distributions are peaked as a trained model's
are: a random model earns no reward (so no optimizer step is taken and every "sync" ships the same weights) and its
near-uniform distributions make any bf16 mismatch look small. So each run starts with the run's own SFT warm start
(on the GPU): scripted demos of the CPU demo's multiplication task (Python tool) and the ALFWorld expert's plays.
The report then says whether rewards were earned, how many optimizer steps were taken and whether the saved fp32
weights differ from the warm start's.

What it does:

1. Builds a RANDOMLY initialised model with Qwen2.5-1.5B's shape (``Qwen2Config`` only: 28 layers, hidden 1536,
   12 query / 2 KV heads, MLP 8960, vocabulary 151,936, tied embeddings; no weights are downloaded) and the
   Qwen2.5 tokenizer from :mod:`agentenv.samplers.tiny`, saved in bfloat16 to a temporary directory.
2. Runs ``agentenv run`` (a subprocess, the CLI a user runs) on ALFWorld (the shipped sample's train split unless
   ``$ALFWORLD_DATA`` points at the full games) and on the Python-tool task, an SFT warm start then ``--updates``
   RL updates each, with ``model.backend=vllm``, the local loop backend, ``launch.vllm_gpu_memory_utilization`` /
   ``launch.vllm_sleep`` (colocated), bf16 compute.
3. Prints, per run: generation tokens/s (sampled tokens per second of wall time, and per second of wall time outside
   learner steps and weight syncs), learner step time and MFU (training FLOPs over the learner's OWN step time,
   ``learner_time_s``, which excludes vLLM's sleep/wake around it; FLOPs counted for what the learner computes: the
   decoder on every token, the LM head only on the policy tokens it scores, causal attention; against the device's
   dense bf16 peak looked up by its exact name: H100 SXM, PCIe and NVL differ), weight-sync time
   (``time_publish_s``), peak GPU
   memory (``nvidia-smi``/NVML sampled every 0.2 s: it sees vLLM's allocations, which torch's counters do not), and
   the lag-0 training-inference mismatch: for every saved trajectory sampled entirely by version 0 (the saved
   model), the per-trajectory sequence KL between vLLM's mu and the learner's pi (recomputed here exactly as the
   learner does: fp32 weights, bf16 autocast, :func:`agentenv.trainer.logprobs.token_log_probs`,
   :func:`agentenv.trainer.objectives.sequence_kl`), its distribution, and the gate's acceptance at delta = 1e-3; also
   the same with an fp32 learner forward (which side the mismatch comes from), and update 1's logged
   ``acceptance_rate`` / ``seq_kl_mean``; version 0 is the SFT model, so the distributions are peaked.
   Targets (issue 11): MFU >= 35%, weight sync <= 2 s, lag-0 acceptance >= 99% in bf16.

Exit status: 2 with a message when there is no CUDA device or no vLLM; 1 when a run failed; else 0.
``--analyze RUN_DIR`` prints the report for an existing run directory (works on CPU, for any sampler).

    python benchmarks/gpu_run.py                       # both tasks, 4 updates each
    python benchmarks/gpu_run.py --tasks alfworld --updates 3 --timeout-s 300
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity), matched in this order against torch's device name (e.g.
# "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" are not); --peak-tflops overrides.
PEAK_TFLOPS = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H800 PCIe", 756.0), ("GH200", 989.4), ("H200", 989.4),
               ("H100", 989.4), ("H800", 989.4), ("A100", 312.0), ("A800", 312.0), ("L40S", 362.1), ("L40", 181.0),
               ("A6000", 154.8), ("4090", 165.2), ("A10", 125.0)]


def peak_tflops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS if k in device_name), None)
DELTA = 1e-3

# Both runs: colocated (one engine, one learner, one GPU), bf16 compute, an SFT warm start, no evaluation, no
# checkpoints; final_model in fp32 so the report can tell a real weight change from bf16 rounding.
COMMON = ["model.backend=vllm", "model.dtype=bfloat16", "model.gradient_checkpointing=true", "model.save_dtype=float32",
          "loop.backend=local", "loop.queue_size=1", "loop.checkpoint_every=0", "eval.every=0", "eval.at_start=false",
          "eval.at_end=false", "sft.enabled=true", "sft.heldout_demos=32", "run.plot=false", "run.tensorboard=false",
          "launch.gpus=1", "launch.learner_world_size=1", "launch.vllm_engines=1", "launch.vllm_tensor_parallel=1",
          "algo.lr=1e-5", "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0"]
TASKS = {
    "alfworld": ["--env", "alfworld", "--set", "env.num_tasks=12", "--set", "rollout.max_turns=10",
                 "--set", "rollout.max_new_tokens=128", "--set", "rollout.max_total_tokens=4096",
                 "--set", "rollout.max_generated_tokens=1280", "--set", "loop.batch_size=16",
                 "--set", "loop.num_workers=1", "--set", "loop.concurrency=16",
                 "--set", "sft.demos=expert", "--set", "sft.num_demos=96"],
    # the CPU demo's task (6-digit products: the tool is needed), its scripted demos, a GPU-sized context
    "python": ["--env", "python", "--set", "env.tasks=demo", "--set", "env.num_tasks=512",
               "--set", "rollout.max_turns=3", "--set", "rollout.max_new_tokens=64",
               "--set", "rollout.max_total_tokens=1024", "--set", "loop.batch_size=32",
               "--set", "loop.num_workers=1", "--set", "loop.concurrency=32",
               "--set", "sft.demos=scripted", "--set", "sft.tool_fraction=0.5"],
}


# --- preflight / model ----------------------------------------------------------------------------------------------
def preflight() -> str:
    import torch

    if not torch.cuda.is_available():
        _exit2("gpu_run.py: no CUDA device here (torch.cuda.is_available() is False). This check needs one NVIDIA "
               "GPU: it runs the vLLM engine and the learner colocated on it. Nothing was run.")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        _exit2(f"gpu_run.py: vLLM is not importable ({e}); on a CUDA machine: pip install 'agentenv[vllm]'")
    return torch.cuda.get_device_name(0)


def _exit2(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def build_model(out: Path, seed: int = 0) -> Path:
    """Random Qwen2.5-1.5B-shaped weights + the Qwen2.5 tokenizer, saved in bf16 (loadable by transformers and vLLM)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentenv.samplers.tiny import qwen_tokenizer

    torch.manual_seed(seed)
    tok = qwen_tokenizer()
    cfg = Qwen2Config(**QWEN25_15B, bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
                      eos_token_id=tok.eos_token_id, dtype="bfloat16")
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    print(f"model: random Qwen2.5-1.5B shape, {n / 1e9:.3f} B parameters -> {out}")
    return out


# --- peak GPU memory (all processes on the device, vLLM's cumem pool included) ---------------------------------------
class GpuMemorySampler:
    def __init__(self, interval_s: float = 0.2):
        self.interval_s, self.peak_mib, self._stop = interval_s, 0.0, threading.Event()
        self._read = self._reader()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _reader(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            return lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
        except Exception:  # noqa: BLE001 -- no NVML bindings: fall back to the CLI
            if shutil.which("nvidia-smi") is None:
                return None
            cmd = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
            return lambda: float(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()[0])

    def _loop(self):
        while not self._stop.is_set():
            try:
                self.peak_mib = max(self.peak_mib, self._read())
            except Exception:  # noqa: BLE001 -- a failed sample is skipped, not fatal
                pass
            self._stop.wait(self.interval_s)

    def __enter__(self):
        if self._read is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


# --- one run ----------------------------------------------------------------------------------------------------------
def agentenv_cmd() -> list[str]:
    exe = shutil.which("agentenv")
    return [exe] if exe else [sys.executable, "-c", "import sys; from agentenv.cli import main; sys.exit(main())"]


def run_task(task: str, model: Path, run_dir: Path, args) -> tuple[int, float]:
    overrides = [*COMMON, f"loop.total_updates={args.updates}", f"sft.epochs={args.sft_epochs}",
                 f"sft.lr={args.sft_lr}", f"sft.batch_size={args.sft_batch_size}",
                 *([f"sft.num_demos={args.sft_demos}"] if task == "python" else []),
                 f"launch.vllm_gpu_memory_utilization={args.gpu_memory_utilization}",
                 f"launch.vllm_sleep={'true' if args.sleep else 'false'}"]
    if task == "python" and shutil.which("bwrap") is None:
        print("python tool: bubblewrap (bwrap) is not installed here; the tool runs in the plain subprocess sandbox")
        overrides.append("env.kwargs.backend=subprocess")
    cmd = [*agentenv_cmd(), "run", *TASKS[task], "--model", str(model), "--run-dir", str(run_dir), "--no-progress"]
    for o in overrides:
        cmd += ["--set", o]
    print(f"\n=== {task}: {' '.join(cmd)}", flush=True)
    with GpuMemorySampler() as mem:
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, timeout=args.timeout_s).returncode
        except subprocess.TimeoutExpired:
            print(f"{task}: stopped at the {args.timeout_s}s limit; reporting what the run wrote")
            rc = 124
        wall = time.perf_counter() - t0
    print(f"{task}: exit {rc} after {wall:.0f}s, peak GPU memory {mem.peak_mib / 1024:.1f} GiB (all processes)")
    return rc, mem.peak_mib


# --- report -----------------------------------------------------------------------------------------------------------
def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_flops(cfg: dict, n_params: int, tokens: float, scored: float, mean_len: float) -> float:
    """One update's training FLOPs (forward + backward = 3x the forward's 2 per weight): the decoder's weights on
    every token (``n_params`` less the embedding table, which is a lookup, and the LM head), causal attention
    6 L d_attn T_mean per token (half of the full 12 L d T), and the LM head (d x V) only on the ``scored`` policy
    tokens, which is all the learner's chunked log-prob computes it for. Checkpoint recomputation is not counted
    (MFU, not hardware FLOPs utilisation)."""
    d, v = cfg["hidden_size"], cfg["vocab_size"]
    d_attn = cfg["num_attention_heads"] * (cfg.get("head_dim") or d // cfg["num_attention_heads"])
    body = n_params - d * v * (1 if cfg.get("tie_word_embeddings") else 2)
    return tokens * (6 * body + 6 * cfg["num_hidden_layers"] * d_attn * mean_len) + scored * 6 * d * v


def quantiles(xs: list[float]) -> str:
    import numpy as np

    if not xs:
        return "n/a"
    q = np.quantile(np.asarray(xs, dtype=float), [0.5, 0.9, 0.99])
    return f"p50 {q[0]:.2e}  p90 {q[1]:.2e}  p99 {q[2]:.2e}  max {max(xs):.2e}  (n={len(xs)})"


def lag0_kl(run_dir: Path, model_path: str, device: str, autocast: bool, limit: int = 64) -> list[float]:
    """Per-trajectory sequence KL(mu || pi) for trajectories sampled entirely by version 0 (= the weights in
    ``model_path``), pi recomputed the way the learner does it."""
    import torch
    from transformers import AutoModelForCausalLM

    from agentenv.trainer.logprobs import token_log_probs
    from agentenv.trainer.objectives import sequence_kl

    def version_0_only(t: dict) -> bool:
        sampled = {v for v, m in zip(t.get("policy_version") or [], t.get("action_mask") or []) if m}
        return sampled == {0}

    trajs = [t for t in read_jsonl(run_dir / "trajectories.jsonl") if version_0_only(t)]
    if not trajs:
        return []
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    out = []
    for t in trajs[:limit]:
        ids = torch.tensor([t["token_ids"]], device=device)
        mask = torch.tensor([t["action_mask"]], device=device, dtype=torch.bool)
        with torch.no_grad(), torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
            logp, _ = token_log_probs(model, ids, torch.ones_like(ids), mask)
        mu = torch.tensor([t["behavior_logprobs"]], device=device, dtype=torch.float64)
        out.append(float(sequence_kl(logp.double(), mu, mask)[0]))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def learning(run_dir: Path, ups: list[dict], start: str) -> dict:
    """Did the check train anything: rewards earned, optimizer steps taken, fp32 weights moved from the start."""
    import torch
    from safetensors.torch import load_file

    stepped = sum(1 - int(m.get("optimizer_step_skipped", 0)) for m in ups)
    success = [m.get("success_rate", 0.0) for m in ups]
    moved = None
    final = sorted((run_dir / "final_model").glob("*.safetensors"))
    first = sorted(Path(start).glob("*.safetensors"))
    if final and first:
        a = {k: v for f in final for k, v in load_file(f).items()}
        b = {k: v for f in first for k, v in load_file(f).items()}
        moved = sum(not torch.equal(a[k].float(), b[k].float()) for k in a if k in b)
    shown = success if len(success) <= 8 else success[:4] + success[-4:]
    print(f"learning: success rate per update {', '.join(f'{s:.2f}' for s in shown)}"
          f"{' (first and last 4)' if len(success) > 8 else ''}; {stepped} of {len(ups)} "
          f"updates took an optimizer step; {moved if moved is not None else '?'} tensors of final_model differ "
          f"from the warm start" + ("" if stepped and moved else
                                    " -- NOTHING WAS LEARNED: the figures below do not measure real updates"))
    return {"optimizer_steps": stepped, "tensors_moved": moved, "success": success}


def report(task: str, run_dir: Path, model_path: str, device: str, peak_tflops: float | None,
           peak_mem_mib: float | None) -> dict:
    ups = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m.get("event") not in ("eval", "shutdown")
           and "update" in m]
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    comp = summary.get("components") or summary.get("summary", {}).get("components")
    print(f"\n--- {task}: {len(ups)} updates in {run_dir}")
    if comp is not None:
        print(f"components: {json.dumps(comp)}")
        if comp.get("sampler") != "vllm":
            print(f"WARNING: the run sampled with {comp.get('sampler')!r}, not vLLM: the figures below are not vLLM's")
    res: dict = {"task": task, "updates": len(ups)}
    if not ups:
        print("no update was logged: nothing to report (see the run's output above)")
        return res
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    wall = ups[-1].get("elapsed_s") or summary.get("summary", {}).get("wall_s")
    t_learn = sum(m.get("time_learner_s", 0.0) for m in ups)
    t_pub = sum(m.get("time_publish_s", 0.0) for m in ups)
    sampled = sum(m.get("policy_tokens_mean", 0.0) * m.get("batch_size", 0) for m in ups)
    if wall:
        awake = max(1e-9, wall - t_learn - t_pub)
        res.update(gen_tok_s=sampled / wall, gen_tok_s_awake=sampled / awake)
        print(f"generation: {sampled:.0f} sampled tokens, {res['gen_tok_s']:.0f} tok/s of wall time, "
              f"{res['gen_tok_s_awake']:.0f} tok/s outside learner steps and weight syncs")
    steps = [m.get("learner_time_s") or m["time_learner_s"] for m in ups if "time_learner_s" in m]
    print(f"learner step: mean {sum(steps) / len(steps):.2f}s, max {max(steps):.2f}s (its own step, "
          f"{sum(m['time_learner_s'] for m in ups) / len(ups):.2f}s mean with vLLM's sleep/wake around it)")
    res.update(learning(run_dir, ups, model_path))
    if peak_tflops and all("tokens" in m for m in ups):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):  # shapes only: no memory, no init
            shell = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
        n = sum(p.numel() for p in shell.parameters())
        mfus = []
        for m in ups:
            mean_len = m["tokens"] / max(1, m.get("batch_size", 1))
            scored = m.get("policy_tokens_mean", 0.0) * m.get("batch_size", 0)
            step_s = m.get("learner_time_s") or m["time_learner_s"]  # the learner's own step, no sleep/wake
            mfus.append(training_flops(cfg, n, m["tokens"], scored, mean_len) / step_s / (peak_tflops * 1e12))
        res["mfu"] = sum(mfus) / len(mfus)
        print(f"learner MFU: mean {100 * res['mfu']:.1f}% (min {100 * min(mfus):.1f}%, max {100 * max(mfus):.1f}% over "
              f"{len(mfus)} updates; over learner_time_s; peak {peak_tflops} TFLOP/s bf16) -- target >= 35%")
    pubs = [m["time_publish_s"] for m in ups if "time_publish_s" in m]
    res["sync_s"] = max(pubs) if pubs else None
    print(f"weight sync (time_publish_s): mean {sum(pubs) / len(pubs):.2f}s, max {max(pubs):.2f}s -- target <= 2 s")
    if peak_mem_mib is not None:
        res["peak_gib"] = peak_mem_mib / 1024
        print(f"peak GPU memory: {res['peak_gib']:.1f} GiB")
    first = ups[0]
    if first.get("lag_max", 0) == 0:
        print(f"update 1 (lag 0, logged by the learner): acceptance_rate {first.get('acceptance_rate')}, "
              f"seq_kl_mean {first.get('seq_kl_mean')}, seq_kl_max {first.get('seq_kl_max')}")
    for label, autocast in (("bf16 autocast (as the learner)", True), ("fp32 forward", False)):
        kls = lag0_kl(run_dir, model_path, device, autocast)  # version 0 = the warm start (peaked)
        if not kls:
            print("lag 0: no trajectory was sampled entirely by version 0")
            break
        acc = sum(k <= DELTA for k in kls) / len(kls)
        res[f"lag0_accept_{'bf16' if autocast else 'fp32'}"] = acc
        print(f"lag-0 seq KL(mu||pi), learner {label}: {quantiles(kls)}; acceptance at delta={DELTA}: "
              f"{100 * acc:.1f}%" + (" -- target >= 99%" if autocast else ""))
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=["alfworld", "python"])
    p.add_argument("--updates", type=int, default=4, help="updates per task (3-5)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="the vLLM engine's share of the GPU")
    p.add_argument("--no-sleep", dest="sleep", action="store_false",
                   help="keep the engine's memory during learner steps")
    p.add_argument("--timeout-s", type=int, default=420, help="wall-clock limit per run (SFT included)")
    p.add_argument("--peak-tflops", type=float, default=None, help="device bf16 dense peak (default: by device name)")
    p.add_argument("--sft-epochs", type=int, default=2, help="warm-start SFT epochs")
    p.add_argument("--sft-lr", type=float, default=1e-4, help="warm-start SFT learning rate")
    p.add_argument("--sft-batch-size", type=int, default=16)
    p.add_argument("--sft-demos", type=int, default=1600, help="scripted demos for the Python-tool warm start")
    p.add_argument("--workdir", default=None, help="where the model and runs go (default: a temp dir, kept)")
    p.add_argument("--analyze", default=None, metavar="RUN_DIR", help="only print the report for an existing run")
    p.add_argument("--model", default=None, help="with --analyze: the model directory the run started from")
    args = p.parse_args()

    if args.analyze:
        import torch

        run_dir = Path(args.analyze)
        model = args.model or _model_of(run_dir)
        report(run_dir.name, run_dir, model, "cuda" if torch.cuda.is_available() else "cpu", args.peak_tflops, None)
        return 0
    device_name = preflight()
    peak = args.peak_tflops or peak_tflops(device_name)
    print(f"device: {device_name}; bf16 peak {peak or 'unknown (pass --peak-tflops)'} TFLOP/s; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="agentenv-gpu-run-"))
    model = build_model(work / "qwen2.5-1.5b-random")
    failed = False
    results = []
    for task in args.tasks:
        run_dir = work / f"run-{task}"
        rc, peak_mem = run_task(task, model, run_dir, args)
        failed |= rc not in (0, 124)
        start = run_dir / "sft_model" if (run_dir / "sft_model" / "config.json").exists() else model
        results.append(report(task, run_dir, str(start), "cuda", peak, peak_mem))
    print("\nRESULTS " + json.dumps(results))
    return 1 if failed else 0


def _model_of(run_dir: Path) -> str:
    import yaml

    from agentenv.samplers.models import resolve_model

    if (run_dir / "sft_model" / "config.json").exists():  # version 0 of the RL run: its warm start
        return str(run_dir / "sft_model")
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return resolve_model(cfg["model"]["name"]).path


if __name__ == "__main__":
    sys.exit(main())
