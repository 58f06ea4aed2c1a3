"""The one place samplers are built: :func:`sampler_factory` returns a picklable ``make_policy(worker_index)``.

Every caller that needs a sampler goes through it: the training run (the plan's sampler, dtype, device and engine
settings, :func:`agentenv.run.train.policy_factory`), ``agentenv rollout`` (one sampler in this process), and the
rollout backends, which call the factory once per worker -- in this process (local threads) or inside each Ray
actor, which receives the factory pickled by value (so every field is a plain string, number or dict). Worker ``i``
samples with seed ``seed + i``.

* ``backend="hf"``: :class:`HFPolicyFactory` -> :func:`load_hf_policy` -> :class:`~agentenv.samplers.hf_policy.HFPolicy`.
* ``backend="vllm"``: :class:`~agentenv.samplers.vllm_policy.VLLMPolicyFactory` ->
  :class:`~agentenv.samplers.vllm_policy.VLLMPolicy` (vLLM is imported only then: it is an optional dependency).

Model names resolve through :func:`agentenv.samplers.models.resolve_model` (local files only, never a download).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def load_hf_policy(name: str, *, seed: int = 0, device: str | None = None, dtype: str = "auto"):
    """Resolve ``name`` and build an :class:`~agentenv.samplers.hf_policy.HFPolicy` (tokenizer + model) from local
    files only. ``device=None`` picks CUDA when there is one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv.samplers.hf_policy import HFPolicy
    from agentenv.samplers.models import resolve_model

    rm = resolve_model(name)
    tok = AutoTokenizer.from_pretrained(rm.path, local_files_only=True)
    torch_dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(rm.path, local_files_only=True, dtype=torch_dtype)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFPolicy(model, tok, name=rm.name, model_path=rm.path, seed=seed, device=device)


@dataclass
class HFPolicyFactory:
    """``load_hf_policy(model, seed=seed + worker_index)``: each worker samples from its own seeded stream."""

    model: str = "tiny"
    seed: int = 0
    device: str | None = None
    dtype: str = "auto"

    def __call__(self, worker_index: int = 0):
        return load_hf_policy(self.model, seed=self.seed + worker_index, device=self.device, dtype=self.dtype)


def sampler_factory(model: str, backend: str = "hf", *, seed: int = 0, device: str | None = None,
                    dtype: str = "auto", **vllm_options) -> Callable:
    """A picklable ``make_policy(worker_index)`` sampling from ``model`` (a name or a checkpoint directory).

    ``vllm_options`` are :class:`~agentenv.samplers.vllm_policy.VLLMPolicyFactory` fields (``gpu_memory_utilization``,
    ``tensor_parallel``, ``enable_sleep_mode``, ``max_model_len``, ...); vLLM places its own engine, so ``device`` is
    for the transformers sampler only."""
    if backend == "vllm":
        from agentenv.samplers.vllm_policy import VLLMPolicyFactory

        return VLLMPolicyFactory(model, seed=seed, dtype=dtype, **vllm_options)
    if backend != "hf":
        raise ValueError(f"unknown sampler backend {backend!r}: use 'hf' or 'vllm'")
    if vllm_options:
        raise TypeError(f"vLLM engine options for the transformers sampler: {sorted(vllm_options)}")
    return HFPolicyFactory(model=model, seed=seed, device=device, dtype=dtype)
