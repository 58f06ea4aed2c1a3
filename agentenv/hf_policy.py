"""transformers sampling backend (CPU and GPU) with exact behaviour log-probs.

:class:`HFPolicy` samples with its own small decoding loop over a KV cache instead of ``model.generate``: at each step
it computes the processed distribution once (:func:`agentenv.processing.processed_logprobs`: temperature, top-k, top-p),
draws from it, and stores the drawn token's log-probability under that very distribution. No library sampling
default (``generate``'s implicit top_k=50, a model's generation_config) can change what was drawn without being
recorded. Requests in one ``generate`` call are batched (left padding, explicit position ids); requests with
different sampling settings are run as separate groups.

Weights are published with :meth:`HFPolicy.load_weights` which bumps ``policy_version`` under a lock, so a
generation never mixes two weight versions. The load is strict: every key the model has (a tied weight may be
given once) with the model's shape, and no other key; anything else is a ``ValueError`` naming the mismatched keys,
raised BEFORE any tensor is copied, and the version is not bumped.

``backend = "hf"`` is recorded in every trajectory's ``sampling["backend"]``.
"""

from __future__ import annotations

import threading
from itertools import groupby
from typing import Sequence

import torch

from agentenv.policy import Generation, GenerationRequest, SamplingParams
from agentenv.processing import processed_logprobs


class HFPolicy:
    backend = "hf"

    def __init__(self, model, tokenizer, *, name: str = "", model_path: str | None = None, seed: int = 0,
                 device: str | torch.device | None = None, policy_version: int = 0, max_batch_size: int = 64):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "name_or_path", "") or "hf-model"
        self.model_path = model_path
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model.to(self.device)
        self.policy_version = policy_version
        self.max_batch_size = max_batch_size
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._lock = threading.Lock()
        # Stop on the tokenizer's eos and every generation_config eos id, as vLLM does (e.g. Qwen2.5-Instruct:
        # <|im_end|> and <|endoftext|>); agentenv.chat closes a turn correctly whichever of them was sampled.
        self.stop_ids = _ids(tokenizer.eos_token_id) | _ids(getattr(getattr(model, "generation_config", None),
                                                                    "eos_token_id", None))
        if not self.stop_ids:
            raise ValueError("tokenizer has no eos_token_id: the end-of-turn token is needed to stop a turn")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(self.stop_ids))

    # --- weights --------------------------------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None) -> None:
        with self._lock:
            self._check_state_dict(state_dict)
            self.model.load_state_dict(state_dict, strict=False)  # keys checked above; tied copies may be absent
            self.policy_version = self.policy_version + 1 if version is None else version

    def _check_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        own = self.model.state_dict()
        given = set(state_dict)
        present_ptrs = {own[k].data_ptr() for k in given if k in own}
        missing = sorted(k for k in own if k not in given and own[k].data_ptr() not in present_ptrs)
        unexpected = sorted(given - set(own))
        shapes = sorted(f"{k}: got {tuple(state_dict[k].shape)}, model has {tuple(own[k].shape)}"
                        for k in given & set(own) if tuple(state_dict[k].shape) != tuple(own[k].shape))
        problems = [f"{len(v)} {what} (e.g. {', '.join(v[:3])})" for v, what in
                    ((missing, "missing keys"), (unexpected, "unexpected keys"), (shapes, "shape mismatches")) if v]
        if problems:
            raise ValueError(
                f"load_weights: the state dict does not match the sampler's model ({'; '.join(problems)}); nothing "
                f"was loaded and policy_version stays {self.policy_version}. Publish the learner's full state dict "
                "with the model's own parameter names."
            )

    # --- sampling -------------------------------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        out: list[Generation | None] = [None] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: _key(requests[i]))
        with self._lock, torch.inference_mode():
            for _, group in groupby(order, key=lambda i: _key(requests[i])):
                idx = list(group)
                for s in range(0, len(idx), self.max_batch_size):
                    chunk = idx[s:s + self.max_batch_size]
                    for i, gen in zip(chunk, self._generate_batch([requests[i] for i in chunk])):
                        out[i] = gen
        return out  # type: ignore[return-value]

    def _generate_batch(self, reqs: list[GenerationRequest]) -> list[Generation]:
        sp: SamplingParams = reqs[0].sampling
        want_entropy = any(r.return_entropy for r in reqs)
        n, dev = len(reqs), self.device
        lengths = [len(r.prompt_ids) for r in reqs]
        if min(lengths) == 0:
            raise ValueError("empty prompt")
        width = max(lengths)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long, device=dev)
        mask = torch.zeros((n, width), dtype=torch.long, device=dev)
        for i, r in enumerate(reqs):  # left padding keeps every row's next token in the last column
            ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids, device=dev)
            mask[i, width - lengths[i]:] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        max_new = max(r.sampling.max_new_tokens for r in reqs)
        tokens, logps, ents = [[] for _ in reqs], [[] for _ in reqs], [[] for _ in reqs]
        done = [False] * n
        stopped = [False] * n
        past, step_ids, step_pos = None, ids, positions
        for step in range(max_new):
            res = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                             past_key_values=past, use_cache=True, logits_to_keep=1)
            past = res.past_key_values
            logp = processed_logprobs(res.logits[:, -1, :], sp.temperature, sp.top_p, sp.top_k)
            nxt = torch.multinomial(logp.exp(), 1, generator=self.generator).squeeze(-1)
            chosen = logp.gather(-1, nxt[:, None]).squeeze(-1)
            if want_entropy:
                p = logp.exp()
                ent = -(p * logp.nan_to_num(neginf=0.0)).sum(-1)
            for i in range(n):
                if done[i]:
                    continue
                t = int(nxt[i])
                tokens[i].append(t)
                logps[i].append(float(chosen[i]))
                if want_entropy:
                    ents[i].append(float(ent[i]))
                if t in self.stop_ids:
                    done[i] = stopped[i] = True
                elif len(tokens[i]) >= reqs[i].sampling.max_new_tokens:
                    done[i] = True
            if all(done):
                break
            # Finished rows keep decoding a pad token (ignored), so the batch shape stays rectangular.
            nxt = torch.where(torch.tensor(done, device=dev), torch.full_like(nxt, self.pad_id), nxt)
            step_ids = nxt[:, None]
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=dev)], dim=1)
        return [
            Generation(token_ids=tokens[i], logprobs=logps[i], stop_reason="stop" if stopped[i] else "length",
                       policy_version=self.policy_version,
                       entropies=ents[i] if reqs[i].return_entropy else None)
            for i in range(n)
        ]


def _ids(x) -> set[int]:
    return {x} if isinstance(x, int) else {int(i) for i in (x or [])}


def _key(r: GenerationRequest) -> tuple:
    s = r.sampling
    return (s.temperature, s.top_p, s.top_k)
