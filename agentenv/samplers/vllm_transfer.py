"""The engine side of vLLM's weight-transfer protocol, as methods of :class:`.vllm_policy.VLLMPolicy`.

Contract (the four phases are described in :mod:`agentenv.samplers.weight_transfer`):

* ``weight_transfer`` (a ``VLLMPolicy`` argument, ``launch.weight_transfer``) names the transport; ``auto`` resolves
  by platform (:func:`.weight_transfer.resolve_transport`). ``None`` / ``"object_store"``: no transfer engine, weights
  come through :meth:`VLLMPolicy.load_weights` only.
* :meth:`init_weight_transfer` (phase 1, once) joins the trainer's group. Per update:
  :meth:`start_weight_update` pauses admission, waits for the requests in flight and holds every later request
  (and ``load_weights``) off until :meth:`finish_weight_update`; :meth:`receive_weights` takes each chunk the trainer sends
  (names and shapes checked against the checkpoint); :meth:`finish_weight_update` finalises the engine's load, drops
  the prefix cache and only then moves ``policy_version``. So a generation never mixes versions.
* Any failure inside the engine during an update marks the policy unusable (``generate`` raises), as a failed
  :meth:`VLLMPolicy.load_weights` does: the engine may hold half the new weights.

The mixin reads the policy's ``llm``, ``_cond``, ``_updating``, ``_asleep``, ``_broken``, ``_shapes``, ``model_path``,
``policy_version`` and ``_idle`` / ``_check_usable``.
"""

from __future__ import annotations

from .vllm_support import _check_against_checkpoint


class WeightTransferReceiver:
    """Mixin: the engine side of a weight transfer (see the module docstring)."""

    @staticmethod
    def _transfer_backend(requested: str | None, colocated: bool) -> str | None:
        if requested is None:
            return None
        from vllm.platforms import current_platform

        from . import weight_transfer  # registers vLLM's "gloo" weight-transfer engine before the engine is built

        return weight_transfer.resolve_transport(requested, cpu=current_platform.is_cpu(), colocated=colocated)

    def transfer_spec(self) -> dict:
        """What the trainer side needs to open a group with this engine: the transport (``object_store`` when there
        is no transfer engine), its worker count (the group has one more rank: the trainer) and its weight dtype
        (what NCCL sends on the wire)."""
        cfg = self.llm.llm_engine.vllm_config
        return {"transport": self.weight_transfer or "object_store", "workers": cfg.parallel_config.world_size,
                "dtype": str(cfg.model_config.dtype).removeprefix("torch.")}

    def init_weight_transfer(self, init_info: dict) -> None:
        """Phase 1, once: the engine joins the trainer's transfer group (blocks until the trainer side joins too)."""
        if self.weight_transfer in (None, "object_store"):
            raise RuntimeError("this engine was built without a weight-transfer backend (weight_transfer=None or "
                               "'object_store'); use load_weights")
        self._engine_rpc("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        """Phase 4 opens: waits for the requests in flight; later ones wait until :meth:`finish_weight_update`."""
        with self._cond:
            self._idle()
            if self._asleep:
                raise RuntimeError("start_weight_update on a sleeping engine: wake_up() first")
            self._updating = True
            self._engine_rpc("start_weight_update")

    def receive_weights(self, update_info: dict) -> None:
        """One chunk of the open update: the engine receives it from the trainer and loads it (names and shapes are
        checked against the checkpoint first; the engine is mid-update, so a wrong one also marks it unusable)."""
        import torch

        with self._cond:
            if not self._updating:
                raise RuntimeError("receive_weights outside an update: call start_weight_update first")
            try:
                _check_against_checkpoint({n: torch.empty(s, device="meta") for n, s in
                                           zip(update_info["names"], update_info["shapes"])}, self._shapes,
                                          self.model_path)
            except ValueError as e:
                self._fail(e)
                raise
            self._engine_rpc("update_weights", update_info=update_info)

    def finish_weight_update(self, version: int | None = None) -> int:
        """Phase 4 closes: the engine finalises the load, the prefix cache is dropped, then ``policy_version`` moves."""
        with self._cond:
            if not self._updating:
                raise RuntimeError("finish_weight_update without start_weight_update")
            self._engine_rpc("finish_weight_update")
            if self.llm.reset_prefix_cache() is False:
                e = RuntimeError("vLLM refused to reset its prefix cache after a weight update")
                self._fail(e)
                raise e
            self._updating = False
            self.policy_version = self.policy_version + 1 if version is None else version
            self._cond.notify_all()
            return self.policy_version

    def _engine_rpc(self, method: str, **kwargs) -> None:
        try:
            self.llm.collective_rpc(method, kwargs=kwargs)
        except BaseException as e:
            self._fail(e)
            raise

    def _fail(self, e: BaseException) -> None:
        self._broken = f"a weight update failed inside the engine ({type(e).__name__}: {e})"
        self._cond.notify_all()
