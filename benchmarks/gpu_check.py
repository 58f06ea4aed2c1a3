"""GPU check (run where CUDA is available): the learner and sampler paths that CPU tests cannot reach.

1. Chunked vs naive current-policy log-probs on CUDA at vocab 151,665 (Qwen2.5) and hidden 896 (Qwen2.5-0.5B's
   width): peak GPU memory and time of forward + backward, printed as ratios; results checked equal.
2. ``Learner.update`` with bf16 autocast on CUDA on a tiny Qwen2 model with the real vocabulary: a few updates,
   stats finite, loss/grad norm close to the float32 update of the same batch.
3. ``HFPolicy`` sampling on CUDA: behaviour log-probs equal an independent full forward pass (float32).

    python benchmarks/gpu_check.py
"""

from __future__ import annotations

import copy
import math
import time

import torch

VOCAB = 151_665


def logprob_memory(hidden: int = 896, token_counts=(4096, 16384, 32768), chunk: int = 1024) -> None:
    from agentenv.trainer.logprobs import chunked_log_probs, naive_log_probs

    print(f"[1] log-probs on {torch.cuda.get_device_name()} (vocab {VOCAB:,}, hidden {hidden}, chunk {chunk})")
    for n in token_counts:
        row = {}
        for method in ("naive", "chunked"):
            torch.manual_seed(0)
            h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = (0.02 * torch.randn(VOCAB, hidden, device="cuda", dtype=torch.bfloat16)).requires_grad_()
            y = torch.randint(0, VOCAB, (n,), device="cuda")
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            try:
                lp, _ = (chunked_log_probs(h, w, y, chunk_size=chunk) if method == "chunked" else naive_log_probs(h, w, y))
                lp.float().sum().backward()
                torch.cuda.synchronize()
            except torch.OutOfMemoryError:
                row[method] = None
                print(f"    {method:8s} {n:6d} tokens: out of memory")
                continue
            row[method] = (lp.detach().float(), (torch.cuda.max_memory_allocated() - base) / 2**30, time.perf_counter() - t0)
            del h, w, lp
            torch.cuda.empty_cache()
        if row.get("naive") and row.get("chunked"):
            (a, ma, ta), (b, mb, tb) = row["naive"], row["chunked"]
            print(f"    {n:6d} tokens: naive {ma:6.2f} GiB {ta*1e3:7.1f} ms | chunked {mb:6.2f} GiB {tb*1e3:7.1f} ms | "
                  f"memory ratio {ma / mb:5.1f}x, time ratio (naive/chunked) {ta / tb:4.2f}, max|dlogp| {(a - b).abs().max():.2e}")
        elif row.get("chunked"):
            print(f"    {n:6d} tokens: chunked {row['chunked'][1]:6.2f} GiB {row['chunked'][2]*1e3:7.1f} ms (naive did not fit)")


def learner_bf16() -> None:
    from agentenv.samplers.tiny import TinyConfig, tiny_model
    from agentenv.trainer.learner import Learner, LearnerConfig
    from agentenv.core.trajectory import Trajectory

    torch.manual_seed(0)
    base = tiny_model(TinyConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4))
    g = torch.Generator().manual_seed(1)

    def batch(tag: str):
        out = []
        for i in range(8):
            n_prompt, n_act = 40 + 7 * i, 30 + 11 * i
            ids = torch.randint(0, 151_000, (n_prompt + n_act,), generator=g).tolist()
            mask = [False] * n_prompt + [True] * n_act
            lps = [0.0] * n_prompt + (-torch.rand(n_act, generator=g) * 8 - 4).tolist()
            out.append(Trajectory(id=f"{tag}-{i}", token_ids=ids, action_mask=mask, behavior_logprobs=lps,
                                  policy_version=[-1] * n_prompt + [0] * n_act, reward=float(i % 3 == 0),
                                  success=i % 3 == 0, sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0}))
        return out

    print("[2] Learner.update: bf16 autocast on CUDA vs float32 on CPU, same batch (delta=inf so every row trains)")
    b0 = batch("a")
    cfg = LearnerConfig(lr=1e-5, loss={"delta": math.inf})
    gpu = Learner(copy.deepcopy(base), cfg, device="cuda")
    cpu = Learner(copy.deepcopy(base), LearnerConfig(lr=1e-5, loss={"delta": math.inf}, autocast="none"), device="cpu")
    s_gpu, s_cpu = gpu.update(b0), cpu.update(copy.deepcopy(b0))
    for k in ("loss", "grad_norm", "acceptance_rate", "ratio_mean", "seq_kl_mean"):
        print(f"    {k:16s} cuda-bf16 {s_gpu[k]: .6g}   cpu-fp32 {s_cpu[k]: .6g}")
    for step in range(3):
        s = gpu.update(batch(f"b{step}"))
        assert all(math.isfinite(v) for v in s.values() if isinstance(v, float)), s
    print(f"    3 more bf16 updates: finite stats, policy_version {gpu.policy_version}, last loss {s['loss']:.4g}, "
          f"learner_time {s['learner_time_s']:.3f}s")


def sampler_cuda() -> None:
    from agentenv.samplers.hf_policy import HFPolicy
    from agentenv.core.policy import GenerationRequest, SamplingParams
    from agentenv.core.processing import processed_logprobs
    from agentenv.samplers.tiny import TinyConfig, qwen_tokenizer, tiny_model

    print("[3] HFPolicy on CUDA: behaviour log-probs vs an independent float32 forward")
    tok = qwen_tokenizer()
    model = tiny_model(TinyConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    pol = HFPolicy(model, tok, name="tiny", device="cuda", seed=0)
    prompts = [tok(f"prompt number {i} " * (i + 1), add_special_tokens=False)["input_ids"] for i in range(6)]
    for t, p, k in ((1.0, 1.0, 0), (0.7, 0.9, 20)):
        sp = SamplingParams(temperature=t, top_p=p, top_k=k, max_new_tokens=24)
        gens = pol.generate([GenerationRequest(x, sp) for x in prompts])
        worst = 0.0
        for x, gen in zip(prompts, gens):
            ids = torch.tensor([x + gen.token_ids], device="cuda")
            with torch.no_grad():
                logits = pol.model(ids).logits[0, len(x) - 1:-1].float()
            ref = processed_logprobs(logits, t, p, k).gather(-1, ids[0, len(x):, None])[:, 0]
            worst = max(worst, (ref.cpu() - torch.tensor(gen.logprobs)).abs().max().item())
        print(f"    T={t} top_p={p} top_k={k}: {sum(len(g.token_ids) for g in gens)} tokens, max|dlogp| {worst:.2e}")


if __name__ == "__main__":
    assert torch.cuda.is_available(), "this check needs a CUDA GPU"
    logprob_memory()
    learner_bf16()
    sampler_cuda()
