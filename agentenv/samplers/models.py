"""Model names -> loadable weights (samplers are built from them in :mod:`agentenv.samplers.factory`).

``resolve_model(name)`` accepts, in this order:

* ``"tiny"`` (or ``"tiny:<hidden>x<layers>"``): the built-in tiny Qwen2 model with the real Qwen2.5 vocabulary,
  materialised offline to a directory; ``"tiny-bpe"`` / ``"tiny-bpe:<hidden>x<layers>"``: the same network over the
  small project-trained BPE (fast on a CPU; see :mod:`agentenv.samplers.tiny`); ``"tiny-bpe-alfworld[:HxL]"``: over the BPE
  that also learned ALFWorld's text (the ALFWorld demo's model);
* a local directory holding a transformers checkpoint (``config.json``); a name that is a path (``./x``, ``/x``,
  ``~/x``, ``a/b/c``) but no directory is :class:`ModelNotAvailable` "no such directory", never a hub lookup;
* a friendly alias from :data:`ALIASES` (``qwen2.5-7b`` -> ``Qwen/Qwen2.5-7B-Instruct``) or a hub id, looked up in the
  local Hugging Face cache only -- agentenv never downloads at run time. When the weights are absent it raises
  :class:`ModelNotAvailable` whose message says what to download and where to put it.

``"expert"`` is not a model but a scripted text policy; environments that support it provide one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ALIASES: dict[str, str] = {
    **{f"qwen2.5-{s}": f"Qwen/Qwen2.5-{s.upper()}-Instruct" for s in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")},
    **{f"qwen2.5-math-{s}": f"Qwen/Qwen2.5-Math-{s.upper()}-Instruct" for s in ("1.5b", "7b", "72b")},
    **{f"qwen2.5-coder-{s}": f"Qwen/Qwen2.5-Coder-{s.upper()}-Instruct" for s in ("0.5b", "1.5b", "3b", "7b", "14b", "32b")},
    **{f"qwen3-{s}": f"Qwen/Qwen3-{s.upper()}" for s in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")},
    "llama3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3.2-3b": "meta-llama/Llama-3.2-3B-Instruct",
}


class ModelNotAvailable(RuntimeError):
    """The model cannot be loaded from local files; the message says what to download and where."""


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what the user asked for (recorded as `model`)
    path: str  # local directory AutoModelForCausalLM.from_pretrained can load (recorded as `model_path`)
    hub_id: str | None = None


def _hf_cache_snapshot(hub_id: str) -> Path | None:
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub")
    repo = hub / ("models--" + hub_id.replace("/", "--"))
    ref = repo / "refs" / "main"
    if ref.exists():
        snap = repo / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").exists():
            return snap
    snaps = sorted((repo / "snapshots").glob("*/config.json")) if (repo / "snapshots").exists() else []
    return snaps[-1].parent if snaps else None


def is_tiny(name: str) -> bool:
    """True for the built-in tiny model specs (``tiny``, ``tiny-bpe``, ``tiny-bpe-alfworld``, each with ``:HxL``)."""
    return name.partition(":")[0] in TINY_VOCABS


# tiny model spec base -> the vocabulary it is built over (agentenv.samplers.tiny.TinyConfig.vocab)
TINY_VOCABS = {"tiny": "qwen2.5", "tiny-bpe": "small", "tiny-bpe-alfworld": "small-alfworld"}


def looks_like_path(name: str) -> bool:
    """A filesystem path, never a hub id: absolute, ``./``, ``../``, ``~``, or more than one ``/`` (hub ids are
    exactly ``org/name``)."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def resolve_model(name: str) -> ResolvedModel:
    if is_tiny(name):
        from agentenv.samplers.tiny import TinyConfig, materialize_tiny

        base, _, shape = name.partition(":")
        cfg = TinyConfig(vocab=TINY_VOCABS[base])
        if shape:
            try:
                hidden, layers = (int(x) for x in shape.split("x"))
            except ValueError:
                raise ValueError(f"tiny model spec must look like '{base}:128x4' (hidden x layers), got {name!r}") from None
            heads = max(1, hidden // 32)  # head size 32 (vLLM's CPU kernels need >= 32)
            cfg = TinyConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=4 * hidden, vocab=cfg.vocab,
                             num_attention_heads=heads, num_key_value_heads=max(1, heads // 2))
        return ResolvedModel(name=name, path=str(materialize_tiny(cfg)))
    p = Path(name).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotAvailable(f"{p} is a directory but holds no config.json; it is not a transformers checkpoint")
        return ResolvedModel(name=name, path=str(p.resolve()))
    if looks_like_path(name):
        raise ModelNotAvailable(f"--model {name}: no such directory ({p.resolve()}); give a transformers checkpoint "
                                "directory, 'tiny', or a hub id such as Qwen/Qwen2.5-7B-Instruct")
    hub_id = ALIASES.get(name.lower(), name)
    if "/" not in hub_id:
        raise ModelNotAvailable(
            f"unknown model {name!r}: use 'tiny', a local checkpoint directory, a hub id (org/name) or one of the "
            f"aliases: {', '.join(sorted(ALIASES))}"
        )
    snap = _hf_cache_snapshot(hub_id)
    if snap is None:
        local = f"/path/to/{hub_id.split('/')[-1]}"
        raise ModelNotAvailable(
            f"model {name!r} ({hub_id}) is not available offline (agentenv downloads nothing at run time): on a "
            f"machine with internet run `hf download {hub_id} --local-dir {local}`, then pass --model {local} (or "
            "copy the hub cache into $HF_HOME/hub)")
    return ResolvedModel(name=name, path=str(snap), hub_id=hub_id)
