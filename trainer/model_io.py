"""The learner's model on disk: loading in float32 master precision, and saving a Hugging Face model directory.

Contract:

* :func:`load_learner_model` loads a causal LM directory (offline) with float32 weights whatever its stored dtype or
  ``model.dtype`` say: the learner's master weights and AdamW state are float32; ``model.dtype`` is the compute dtype
  (see :class:`~agentenv.trainer.learner.Learner`). ``meta=True`` builds the same network from its ``config.json``
  on the meta device, with no weights (a sharded learner's ranks: :func:`agentenv.trainer.sharding.fill_from_rank0`).
* :func:`save_pretrained` writes ``out_dir`` as a Hugging Face model directory -- ``config.json`` (its dtype),
  ``generation_config.json``, safetensors weights from the given full state dict cast to ``dtype`` (float32 unless
  asked: a run saves in ``model.save_dtype``, default the compute dtype), and the tokenizer of
  ``source`` when it has one -- loadable by ``AutoModelForCausalLM.from_pretrained`` (and so by vLLM and
  ``agentenv run --model DIR``). The write goes to a temporary sibling directory renamed into place, so a reader sees
  a complete directory or none; an existing ``out_dir`` is replaced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch


def load_learner_model(path: str | os.PathLike, *, meta: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    if meta:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)


def save_pretrained(model, state_dict: dict[str, torch.Tensor], out_dir: str | os.PathLike, *,
                    source: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``state_dict`` (full) as ``model``'s HF directory at ``out_dir`` in ``dtype`` (the module docstring)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        state = {k: v.detach().to("cpu", dtype) if v.is_floating_point() else v.detach().cpu()
                 for k, v in state_dict.items()}
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        _set_config_dtype(tmp / "config.json", dtype)  # transformers writes the in-memory (fp32) model's dtype
        if source is not None:
            _copy_tokenizer(source, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _set_config_dtype(path: Path, dtype: torch.dtype) -> None:
    """config.json says what the weights are (vLLM and ``dtype="auto"`` loaders read it)."""
    import json

    cfg = json.loads(path.read_text())
    name = str(dtype).removeprefix("torch.")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _copy_tokenizer(source, out: Path) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError) as e:  # a model directory without a tokenizer: say so, do not invent one
        raise FileNotFoundError(f"no tokenizer to copy at {source}: {e}") from e
    tok.save_pretrained(out)
