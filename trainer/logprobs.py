"""Current-policy log-probs (and entropies) of sampled tokens without a ``[tokens x vocab]`` log-softmax.

Contract:

* :func:`chunked_log_probs` maps hidden states ``[N, H]`` and the output projection ``[V, H]`` to ``log pi(target)``
  ``[N]`` (float32; float64 for float64 inputs; differentiable w.r.t. hidden, weight and bias) and optionally the
  full categorical entropy ``[N]`` (same dtype, detached). It walks the tokens in chunks: logits, logsumexp and gather per chunk, then frees the chunk.
  The backward recomputes each chunk's logits from the saved inputs, so peak extra memory is O(chunk x V) in both
  passes, not O(N x V). Results match :func:`naive_log_probs` to float32 rounding.
* :func:`token_log_probs` runs a causal LM's body once, keeps only the hidden states that predict policy tokens (the
  state at t-1 predicts token t), and returns ``[B, T]`` log-probs / entropies with zeros off the action mask.
  Position 0 has no prediction, so ``action_mask[:, 0]`` must be False.
* Matmuls run in the hidden states' dtype (bf16 under autocast); logsumexp/softmax always in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_CHUNK = 512  # 512 x 151,665 float32 logits = 0.31 GB per live chunk


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    z = h @ weight.T
    if bias is not None:
        z = z + bias
    z = z.double() if z.dtype == torch.float64 else z.float()  # half precision never reaches logsumexp
    return z / temperature if temperature != 1.0 else z


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, with_entropy):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.zeros_like(logp)
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly by the caller
            for s in range(0, n, chunk_size):
                z = _chunk_logits(hidden[s:s + chunk_size], weight, bias, temperature)
                lse[s:s + chunk_size] = torch.logsumexp(z, dim=-1)
                logp[s:s + chunk_size] = z.gather(1, targets[s:s + chunk_size, None]).squeeze(1) - lse[s:s + chunk_size]
                if with_entropy:
                    p = torch.softmax(z, dim=-1)
                    ent[s:s + chunk_size] = lse[s:s + chunk_size] - (p * z).sum(dim=-1)
                    del p
                del z
        logp.clamp_(max=0.0)  # rounding can leave z_t - lse at +1e-7; the gradient below is the unclamped one
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        c, temp = ctx.chunk_size, ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = lse.dtype  # float32, or float64 for float64 inputs
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, hidden.shape[0], c):
                h, g = hidden[s:s + c], grad_logp[s:s + c].to(acc)
                z = _chunk_logits(h, weight, bias, temp)
                # d log p_target / d z = onehot(target) - softmax(z); scaled by upstream grad and 1/temperature
                gz = torch.exp(z - lse[s:s + c, None]).mul_(-g[:, None])
                gz.scatter_add_(1, targets[s:s + c, None], g[:, None])
                if temp != 1.0:
                    gz.div_(temp)
                del z
                gz_lo = gz.to(hidden.dtype)
                if need_h:
                    grad_h[s:s + c] = gz_lo @ weight.to(hidden.dtype)
                if need_w:
                    grad_w += (gz_lo.T @ h).to(acc)
                if need_b:
                    grad_b += gz.sum(0)
                del gz, gz_lo
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None)


def chunked_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(hidden @ weight.T + bias)[target] / temperature`` per row, chunked. Returns (log_probs, entropy)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V, H] expected, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk_size < 1 or not temperature > 0:
        raise ValueError(f"chunk_size must be >= 1 and temperature > 0, got {chunk_size}, {temperature}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= weight.shape[0]):
        raise ValueError(f"target ids must lie in [0, {weight.shape[0]}), got [{int(targets.min())}, {int(targets.max())}]")
    # Under autocast the lm_head would run in bf16; do that cast once here (autograd routes grads to the fp32 master).
    if weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
    if bias is not None and bias.dtype != hidden.dtype:
        bias = bias.to(hidden.dtype)
    logp, ent = _ChunkedLogProbs.apply(hidden, weight, bias, targets.long(), chunk_size, float(temperature), with_entropy)
    return logp, (ent if with_entropy else None)


def naive_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                    temperature: float = 1.0, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Reference: materialises the full ``[N, V]`` float32 log-softmax. For tests and the memory benchmark only."""
    z = hidden @ weight.to(hidden.dtype).T
    if bias is not None:
        z = z + bias.to(hidden.dtype)
    z = z.double() if z.dtype == torch.float64 else z.float()
    logsm = torch.log_softmax(z / temperature, dim=-1)
    ent = -(logsm.exp() * logsm).sum(-1).detach() if with_entropy else None
    return logsm.gather(1, targets.long()[:, None]).squeeze(1), ent


def token_log_probs(
    model,
    input_ids: Tensor,
    attention_mask: Tensor,
    action_mask: Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``[B, T]`` float32 log pi of each policy token under ``model`` (a HF causal LM), zeros elsewhere; entropies
    likewise when asked. Only the ``N`` policy positions go through the output projection."""
    if action_mask.dtype != torch.bool or action_mask.shape != input_ids.shape:
        raise ValueError("action_mask must be a boolean tensor shaped like input_ids")
    if bool(action_mask[:, 0].any()):
        raise ValueError("action_mask[:, 0] is True: the first token has no context to be predicted from")
    body, head = model.get_decoder(), model.get_output_embeddings()
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    predict = action_mask[:, 1:]  # hidden[:, t-1] predicts token t
    logp, ent = chunked_log_probs(
        hidden[:, :-1][predict], head.weight, input_ids[:, 1:][predict], bias=head.bias,
        chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy,
    )
    out = torch.zeros(input_ids.shape, dtype=logp.dtype, device=input_ids.device)
    out[action_mask] = logp  # differentiable index_put into a fresh tensor
    if not with_entropy:
        return out, None
    ent_out = torch.zeros_like(out)
    ent_out[action_mask] = ent
    return out, ent_out
