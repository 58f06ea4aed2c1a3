"""The trainer's weight sources for vLLM's weight-transfer API (:mod:`.weight_transfer`): what a sender iterates.

* :class:`StateDictSource`: a state dict swapped per publish (:meth:`StateDictSource.set`; the driver's, when the
  learner lives in the driver's process); ``device`` / ``dtype`` move and cast each tensor as it is sent, so the
  full model is never copied at once. Tied tensors (same storage) go once.
* :class:`ModelSource`: a live, possibly FSDP2-sharded model (what each learner rank sends from): every rank
  gathers each tensor on its device in lockstep (``full_tensor()``), cast to the wire dtype there; tied parameters go
  once, by ``named_parameters()`` (the same names on every rank). :meth:`ModelSource.drain` finishes a pass a failed
  send left half way, so the other ranks' gathers complete.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, materialize_full_tensor


class StateDictSource(WeightSource):
    """A ``WeightSource`` over the latest published state dict; each tensor is moved / cast only as it is sent."""

    def __init__(self, state_dict: dict | None = None, *, device: str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.device, self.dtype = device, dtype
        self._items: list[tuple[str, torch.Tensor]] = []
        if state_dict is not None:
            self.set(state_dict)

    def set(self, state_dict: dict) -> None:
        seen: set[tuple[int, tuple]] = set()
        self._items = []
        for name, t in state_dict.items():
            key = (t.data_ptr(), tuple(t.shape))
            if key in seen:  # an alias (tied lm_head): the engine holds it once
                continue
            seen.add(key)
            self._items.append((name, t))
        self._meta = [ParamMeta(n, self.dtype or t.dtype, tuple(t.shape)) for n, t in self._items]

    def metadata(self) -> list[ParamMeta]:
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._items:
            t = materialize_full_tensor(t)
            if self.device is not None or self.dtype is not None:
                t = t.to(device=self.device or t.device, dtype=self.dtype or t.dtype)
            yield name, t


class ModelSource(WeightSource):
    """A ``WeightSource`` over a live (possibly FSDP2-sharded) model, for a trainer side hosted where the weights
    live: each tensor is gathered on its device (``full_tensor()``, a collective every rank runs in lockstep) and cast
    to ``dtype`` there, one at a time, so nothing crosses host memory and no full copy is ever held. Tied tensors go
    once. :meth:`drain` finishes an iteration a failed send left half way, so the other ranks' gathers complete."""

    collective = True  # iterations run on every rank in the same order: sends are sequential, never concurrent

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
        self.model, self.dtype = model, dtype
        self._active: Iterator | None = None
        # named_parameters() lists a tied parameter once, by object identity: the same names on every rank (a
        # storage-based test would not be: an empty shard has no storage)
        own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
        state = model.state_dict()
        self._names = [n for n in state if n in own]
        self._meta = [ParamMeta(n, self._wire_dtype(state[n].dtype), tuple(state[n].shape))  # a DTensor's: global
                      for n in self._names]

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.dtype if self.dtype is not None and dtype.is_floating_point else dtype

    def metadata(self) -> list[ParamMeta]:
        return self._meta

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._active = self._iterate()
        return self._active

    def _iterate(self) -> Iterator[tuple[str, torch.Tensor]]:
        state = self.model.state_dict()
        for name in self._names:
            # no_grad per tensor, never across a yield: a consumer that stops at the last tensor (vLLM's iter_groups
            # does) would otherwise leave grad mode off in its thread for good
            with torch.no_grad():
                t = state[name].detach()
                t = (t.full_tensor() if hasattr(t, "full_tensor") else t).to(self._wire_dtype(t.dtype))
            yield name, t
        self._active = None

    def drain(self) -> None:
        active, self._active = self._active, None
        for _ in active or ():
            pass
