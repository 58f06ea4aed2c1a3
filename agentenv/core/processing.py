"""The sampler's processed distribution: temperature, then top-k, then top-p, renormalised.

``processed_logprobs(logits, temperature, top_p, top_k)`` returns log-probabilities (same shape as ``logits``) of
the distribution a sampler with these settings actually draws from; truncated tokens get ``-inf``. This is the
reference the backends are checked against, and the transformers backend samples from it directly, so the
behaviour log-prob it stores is exactly the probability of the draw.

Order and tie rules match the common samplers (transformers' warpers, vLLM's sampler): scale by 1/temperature;
top-k keeps every token whose logit is >= the k-th largest (ties at the boundary kept); top-p keeps the smallest
prefix of the descending-sorted distribution whose mass reaches ``top_p`` (the token that crosses the threshold is
kept, at least one token always kept).
"""

from __future__ import annotations

import torch


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Mass strictly before each token; a token is dropped once that mass already reached top_p.
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)
