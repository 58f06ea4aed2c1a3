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
* The model's own final-logit processing is applied after the output projection, exactly as its HF forward does
  (:func:`final_logits_of`: Gemma-2/3 ``final_logit_softcapping`` -> ``cap * tanh(z / cap)``, Cohere ``logit_scale``
  -> ``z * s``, Granite ``logits_scaling`` -> ``z / s``), then the temperature. Other post-``lm_head`` processing a
  family may add is not known here: :func:`final_logits_of` refuses config keys that look like one.
* :class:`TokenLogProbs` wraps a model so the whole computation is ONE module forward: FSDP2 (root = the wrapper)
  then gathers the embedding / final norm / LM head around it and reduce-scatters their gradients, which a bare
  read of ``lm_head.weight`` outside a forward would not do.
* Matmuls run in the hidden states' dtype (bf16 under autocast); logsumexp/softmax always in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

DEFAULT_CHUNK = 512  # 512 x 151,665 float32 logits = 0.31 GB buffer (two with entropies)


@dataclass(frozen=True)
class FinalLogits:
    """What a model does to ``lm_head``'s output before the softmax: ``softcap(scale * z)``."""

    scale: float = 1.0
    softcap: float | None = None  # cap * tanh(z / cap)


# config keys of post-lm_head processing we do not implement: refuse rather than compute a different pi than mu
_UNSUPPORTED_LOGIT_KEYS = ("lm_head_multiplier", "dim_model_base")  # Falcon-H1, MiniCPM


def final_logits_of(config) -> FinalLogits:
    """The final-logit processing a HF model config declares (see the module docstring)."""
    for key in _UNSUPPORTED_LOGIT_KEYS:
        if getattr(config, key, None) not in (None, 1, 1.0):
            raise NotImplementedError(f"{type(config).__name__}.{key}={getattr(config, key)} changes the logits after "
                                      "lm_head and is not implemented in the chunked log-prob path")
    scale = 1.0
    if getattr(config, "logit_scale", None) is not None:  # Cohere
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite divides
        scale /= float(config.logits_scaling)
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma-2/3
    return FinalLogits(scale, float(cap) if cap else None)


def _chunk_logits(buf: Tensor, h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                  post: FinalLogits) -> Tensor:
    """Final logits of the chunk ``h`` (projection, ``post``, temperature) written into the reused buffer ``buf``
    (float32/64). Reusing one buffer per pass avoids allocating -- and page-faulting -- a chunk x V block per chunk."""
    out = buf[: h.shape[0]]
    if weight.dtype == out.dtype:
        torch.matmul(h, weight.T, out=out)
    else:  # bf16 matmul as autocast would do it; the softmax below runs in float32
        out.copy_(h @ weight.T)
    if bias is not None:
        out.add_(bias)
    if post.scale != 1.0:
        out.mul_(post.scale)
    if post.softcap is not None:
        out.div_(post.softcap).tanh_().mul_(post.softcap)
    if temperature != 1.0:
        out.div_(temperature)
    return out


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, temperature, with_entropy, post):
        n, vocab = hidden.shape[0], weight.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # half precision never reaches exp/log
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.zeros_like(logp)
        zbuf = torch.empty(min(chunk_size, n), vocab, dtype=acc, device=hidden.device)
        ebuf = torch.empty_like(zbuf) if with_entropy else None
        with torch.autocast(hidden.device.type, enabled=False):  # dtypes are chosen explicitly by the caller
            for s in range(0, n, chunk_size):
                e = min(n, s + chunk_size)
                z = _chunk_logits(zbuf, hidden[s:e], weight, bias, temperature, post)
                target_logit = z.gather(1, targets[s:e, None]).squeeze(1)
                zmax = z.amax(dim=1, keepdim=True)
                z.sub_(zmax)  # z' = z - max <= 0: exp cannot overflow
                if with_entropy:  # H = log S - sum(exp(z') z') / S with S = sum exp(z')
                    ex = torch.exp(z, out=ebuf[: e - s])
                    total = ex.sum(dim=1)
                    ent[s:e] = total.log() - ex.mul_(z).sum(dim=1) / total
                else:
                    total = z.exp_().sum(dim=1)
                lse[s:e] = zmax.squeeze(1) + total.log()
                logp[s:e] = target_logit - lse[s:e]
        del zbuf, ebuf
        logp.clamp_(max=0.0)  # never positive (log S >= 0); the clamp only guards the last ulp
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size, ctx.temperature, ctx.post = chunk_size, temperature, post
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, _grad_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        c, temp, post = ctx.chunk_size, ctx.temperature, ctx.post
        n, acc = hidden.shape[0], lse.dtype
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        zbuf = torch.empty(min(c, n), weight.shape[0], dtype=acc, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for s in range(0, n, c):
                e = min(n, s + c)
                h, g = hidden[s:e], grad_logp[s:e].to(acc)
                # d log p_target / d z = onehot(target) - softmax(z), times the upstream grad (and 1/temperature)
                gz = _chunk_logits(zbuf, h, weight, bias, temp, post)
                # softcap' = 1 - tanh^2 = 1 - (z T / cap)^2, taken from the final logits before they are overwritten
                dcap = 1 - (gz * (temp / post.softcap)).square() if post.softcap is not None else None
                gz.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])
                gz.scatter_add_(1, targets[s:e, None], g[:, None])
                if dcap is not None:
                    gz.mul_(dcap)
                if post.scale / temp != 1.0:
                    gz.mul_(post.scale / temp)
                gz_lo = gz if gz.dtype == hidden.dtype else gz.to(hidden.dtype)
                if need_h:
                    torch.matmul(gz_lo, weight, out=grad_h[s:e])
                if need_w:
                    if grad_w.dtype == h.dtype:
                        grad_w.addmm_(gz_lo.T, h)
                    else:
                        grad_w += (gz_lo.T @ h).to(acc)
                if need_b:
                    grad_b += gz.sum(0)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None, None)


def chunked_log_probs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
    with_entropy: bool = False,
    post: FinalLogits = FinalLogits(),
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(post(hidden @ weight.T + bias) / temperature)[target]`` per row, chunked.
    Returns (log_probs, entropy)."""
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
    logp, ent = _ChunkedLogProbs.apply(hidden, weight, bias, targets.long(), chunk_size, float(temperature),
                                       with_entropy, post)
    return logp, (ent if with_entropy else None)


def naive_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, *, bias: Tensor | None = None,
                    temperature: float = 1.0, with_entropy: bool = False,
                    post: FinalLogits = FinalLogits()) -> tuple[Tensor, Tensor | None]:
    """Reference: materialises the full ``[N, V]`` float32 log-softmax. For tests and the memory benchmark only."""
    z = hidden @ weight.to(hidden.dtype).T
    if bias is not None:
        z = z + bias.to(hidden.dtype)
    z = z.double() if z.dtype == torch.float64 else z.float()
    z = z * post.scale
    if post.softcap is not None:
        z = torch.tanh(z / post.softcap) * post.softcap
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
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):  # the lm_head matmul in the autocast dtype, as model(...) would do it
        hidden = hidden.to(torch.get_autocast_dtype(device_type))
    predict = action_mask[:, 1:]  # hidden[:, t-1] predicts token t
    logp, ent = chunked_log_probs(
        hidden[:, :-1][predict], head.weight, input_ids[:, 1:][predict], bias=head.bias,
        chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy, post=final_logits_of(model.config),
    )
    out = torch.zeros(input_ids.shape, dtype=logp.dtype, device=input_ids.device)
    out[action_mask] = logp  # differentiable index_put into a fresh tensor
    if not with_entropy:
        return out, None
    ent_out = torch.zeros_like(out)
    ent_out[action_mask] = ent
    return out, ent_out


class TokenLogProbs(torch.nn.Module):
    """``model`` wrapped so that :func:`token_log_probs` is this module's forward (the FSDP2 root; see the module
    docstring). Unsharded it is a plain pass-through."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor, action_mask: Tensor, *,
                chunk_size: int = DEFAULT_CHUNK, temperature: float = 1.0,
                with_entropy: bool = False) -> tuple[Tensor, Tensor]:
        logp, ent = token_log_probs(self.model, input_ids, attention_mask, action_mask, chunk_size=chunk_size,
                                    temperature=temperature, with_entropy=with_entropy)
        return logp, ent if ent is not None else torch.zeros_like(logp)  # FSDP hooks want tensors, not None
