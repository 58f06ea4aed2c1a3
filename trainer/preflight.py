"""Before a run: will the trust gate admit what the sampler produces at lag 0?

FlashREINFORCE evaluates pi at the sampling temperature only; a sampler that also truncates (top-k, top-p < 1) draws
from a different distribution mu, so even with identical weights (lag 0) the per-trajectory sequence KL between mu
and pi can exceed delta and the gate rejects everything (top_k = 5 on a near-uniform model: KL 0.7-0.9 >> 1e-3).

Contract of :func:`lag0_trust_check`: sample ``n_sequences`` short generations (``n_tokens`` each) from ``model``
through the real sampler (:class:`agentenv.samplers.hf_policy.HFPolicy`, the processed distribution) with the given
settings, score the sampled tokens with the learner's pi (:func:`~agentenv.trainer.logprobs.token_log_probs`,
temperature only), and return ``(acceptance, seq_kl)``: the share of generations whose mean sampled-token Bernoulli
KL(mu || pi) is <= ``delta`` (the gate's own rule, :func:`~agentenv.trainer.objectives.sequence_kl`) and the mean of that
KL. Deterministic for a given ``seed``. The caller (the run's preflight) refuses settings whose acceptance is below
its bound unless ``algo.allow_truncated_sampling`` is set.
"""

from __future__ import annotations

import torch

from .logprobs import token_log_probs
from .objectives import sequence_kl


def lag0_trust_check(model, tokenizer, *, temperature: float, top_p: float, top_k: int, delta: float,
                     n_tokens: int = 32, n_sequences: int = 4, prompt: str = "Write a short story about a robot.",
                     seed: int = 0) -> tuple[float, float]:
    """See the module docstring. Returns ``(acceptance, mean sequence KL)``."""
    from agentenv.samplers.hf_policy import HFPolicy
    from agentenv.core.policy import GenerationRequest, SamplingParams

    if n_tokens < 1 or n_sequences < 1:
        raise ValueError(f"need n_tokens >= 1 and n_sequences >= 1, got {n_tokens}, {n_sequences}")
    prompt_ids = tokenizer(prompt)["input_ids"]
    device = next(model.parameters()).device
    sampler = HFPolicy(model, tokenizer, seed=seed, device=device)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=n_tokens)
    gens = sampler.generate([GenerationRequest(prompt_ids, sampling) for _ in range(n_sequences)])
    width = len(prompt_ids) + max(len(g.token_ids) for g in gens)
    ids = torch.zeros(n_sequences, width, dtype=torch.long)
    attn = torch.zeros(n_sequences, width, dtype=torch.bool)
    act = torch.zeros_like(attn)
    mu = torch.zeros(n_sequences, width, dtype=torch.float64)
    for i, g in enumerate(gens):
        n = len(prompt_ids) + len(g.token_ids)
        ids[i, :n] = torch.tensor(prompt_ids + g.token_ids)
        attn[i, :n] = True
        act[i, len(prompt_ids):n] = True
        mu[i, len(prompt_ids):n] = torch.tensor(g.logprobs, dtype=torch.float64)
    with torch.no_grad():
        pi, _ = token_log_probs(model, ids.to(device), attn.to(device), act.to(device), temperature=temperature)
    kl = sequence_kl(pi.double().cpu(), mu, act)
    return float((kl <= delta).double().mean()), float(kl.mean())
