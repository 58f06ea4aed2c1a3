"""Weights from the learner to vLLM engines through vLLM's weight-transfer API, with a gloo backend for CPU.

vLLM (0.32) moves a trainer's weights into running engines in four phases: the engine side and the trainer side
each initialise once (``init_weight_transfer_engine`` on the workers; ``trainer_init`` opening the group), then per
update the trainer sends and the engine receives + loads (``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` on the workers, concurrent with the trainer's ``send_weights``). It ships NCCL (engines on
other GPUs) and CUDA IPC (colocated) backends; this module adds ``"gloo"`` so a CPU run (and CI) drives the same
four phases end to end. Contract:

* :func:`register` puts :class:`GlooWeightTransferEngine` (engine side, a vLLM ``WeightTransferEngine``) and
  :class:`GlooTrainerWeightTransferEngine` (trainer side) into vLLM's two registries under ``"gloo"``; it is
  idempotent and runs on import. The engine must be built in a process where this module was imported (on CPU it
  runs in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with ``weight_transfer_config={"backend": "gloo"}``.
* The group is a torch gloo ``ProcessGroupGloo`` over its own ``TCPStore`` (no ``init_process_group``, so a
  learner's own FSDP group is untouched): the trainer is rank 0 and hosts the store (port 0 = a free port it reports
  to the engine), the engine's workers are ranks ``1..world_size-1``. ONE group per engine: a dead engine breaks
  only its own group, and a restarted one gets a new group without touching the others.
* Each update sends the tensors layer by layer (vLLM's :func:`layerwise_groups`): one broadcast per decoder layer,
  the layer's tensors packed as bytes, so any dtype travels unchanged (the engine's loader casts to its dtype).
  Aliased tensors (a tied ``lm_head.weight`` sharing the embedding's storage) go once; an engine whose model ties
  them never loads a separate ``lm_head.weight``.
* The engine side loads through vLLM's layerwise reload (initialised in ``start_weight_update``, finalised in
  ``finish_weight_update``), then on CPU re-packs the GEMM handles vLLM leaves stale
  (:func:`.vllm_support.repack_cpu_gemms`), exactly as :meth:`VLLMPolicy.load_weights` does.
* The senders iterate a ``WeightSource`` of :mod:`.weight_sources`: a live (possibly FSDP2-sharded) model on each
  learner rank (``ModelSource``), or the state dict the driver holds (``StateDictSource``).
* :class:`TransferSender` holds one trainer engine per rollout engine in the process that sends (a learner rank or
  the driver) and sends to a list of them: concurrently over a state dict, one after the other when iterating the
  source is a collective; a failed engine is reported, not raised, after the source is drained so the other ranks'
  gathers complete.
* :func:`resolve_transport` picks the transport for ``launch.weight_transfer=auto``: ``gloo`` on CPU, ``ipc`` for a
  CUDA engine colocated with the learner, ``nccl`` for engines on other GPUs; ``object_store`` (Ray's, one
  ``ray.put`` per update) is only ever the explicit choice. :func:`trainer_engine` opens the trainer side of any of
  gloo / nccl / ipc against a client (``VLLMWeightSyncClient``: the four control-plane calls; :class:`PolicyClient`
  for a policy in this process).
"""

from __future__ import annotations

import datetime
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo, TrainerWeightTransferEngine, WeightSource, WeightTransferEngine, WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

TRANSPORTS = ("auto", "gloo", "nccl", "ipc", "object_store")
DEFAULT_TIMEOUT_S = 600.0  # a broadcast whose peer never comes fails after this, instead of hanging the run
_PREFIX = "agentenv-weights"


def resolve_transport(requested: str, *, cpu: bool, colocated: bool) -> str:
    """The transport a run uses: ``requested`` unless it is ``auto`` (see the module docstring)."""
    if requested not in TRANSPORTS:
        raise ValueError(f"launch.weight_transfer={requested!r}: use one of {', '.join(TRANSPORTS)}")
    if requested != "auto":
        return requested
    if cpu:
        return "gloo"
    return "ipc" if colocated else "nccl"


def _group(host: str, port: int, rank: int, world_size: int, timeout_s: float, store=None):
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(_PREFIX, store), rank, world_size, timeout)


def _broadcast(group, buf: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([buf], opts).wait()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Engine side: where the trainer's store listens; this engine's workers are ranks ``rank_offset + tp rank``."""

    master_address: str
    master_port: int
    world_size: int = 2
    rank_offset: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side (rank 0). ``master_port=0``: the store takes a free port and tells the engine."""

    backend: ClassVar[str] = "gloo"
    master_address: str = "127.0.0.1"
    master_port: int = 0
    world_size: int = 2
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: every tensor's name, dtype and shape, and how many of them each broadcast carries (one per layer)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    group_sizes: list[int]

    def __post_init__(self):
        n = len(self.names)
        if len(self.dtype_names) != n or len(self.shapes) != n or sum(self.group_sizes) != n:
            raise ValueError(f"gloo update info: {n} names, {len(self.dtype_names)} dtypes, {len(self.shapes)} "
                             f"shapes, groups covering {sum(self.group_sizes)}: they must agree")


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Engine side: receives each layer's bytes from rank 0 and loads them through vLLM's layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = _group(init_info.master_address, init_info.master_port, rank, init_info.world_size,
                            init_info.timeout_s)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":  # a CPU receive is done when broadcast() returns
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
        hf = self.model_config.hf_config
        tied = bool(getattr(hf.get_text_config() if hasattr(hf, "get_text_config") else hf,
                            "tie_word_embeddings", False))
        metas = list(zip(update_info.names, update_info.dtype_names, update_info.shapes))
        start = 0
        for size in update_info.group_sizes:
            group = [(n, getattr(torch, d), torch.Size(s)) for n, d, s in metas[start:start + size]]
            start += size
            nbytes = [s.numel() * torch.empty((), dtype=d).element_size() for _, d, s in group]
            buf = torch.empty(sum(nbytes), dtype=torch.uint8)
            _broadcast(self.group, buf)
            pairs, off = [], 0
            for (name, dtype, shape), nb in zip(group, nbytes):
                t = buf[off:off + nb].view(dtype).reshape(shape)
                off += nb
                if not (tied and name == "lm_head.weight"):  # the engine's head IS its embedding
                    pairs.append((name, t.to(self.device)))
            if pairs:
                self.model.load_weights(pairs)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from .vllm_support import repack_cpu_gemms

        finalize_layerwise_reload(self.model, self.model_config)
        repack_cpu_gemms(self.model)

    def shutdown(self) -> None:
        self.group = None


class TransferSender:
    """The trainer side of every engine's weight transfer, hosted in one process of the trainer: the driver (over a
    :class:`StateDictSource` it sets per publish) or each learner rank (over a :class:`ModelSource`; rank 0 sends,
    the other ranks only run the gathers). One trainer engine (one group) per engine ``key``.

    :meth:`send` sends to the given engines, concurrently when the source allows it (a state dict) and one after
    the other when iterating it is a collective; a failed engine does not stop the others and comes back as
    ``{key: "Type: message"}``."""

    def __init__(self, transport: str, source, *, rank: int = 0) -> None:
        self.transport, self.source, self.rank = transport, source, rank
        self.engines: dict = {}

    def open(self, key, client, *, world_size: int, master_address: str | None = None) -> None:
        if master_address is None:
            import ray

            master_address = ray.util.get_node_ip_address()
        self.close(key)
        self.engines[key] = trainer_engine(self.transport, client, self.source, master_address=master_address,
                                           world_size=world_size, rank=self.rank)

    def send(self, keys, version: int) -> dict:
        engines = [(k, self.engines[k]) for k in keys if k in self.engines]
        errors: dict = {}

        def one(key, engine):
            engine.client.version = version
            try:
                engine.send_weights()
            except Exception as e:  # noqa: BLE001 -- reported per engine; the caller decides (dead actor or bug)
                drain = getattr(self.source, "drain", None)
                if drain is not None:
                    drain()  # the other ranks are still gathering: finish the pass with them
                errors[key] = f"{type(e).__name__}: {e}"

        if getattr(self.source, "collective", False) or len(engines) < 2:
            for key, engine in engines:
                one(key, engine)
        else:
            with ThreadPoolExecutor(max_workers=len(engines)) as pool:
                list(pool.map(lambda ke: one(*ke), engines))
        return errors

    def close(self, key=None) -> None:
        for k in list(self.engines) if key is None else [key]:
            engine = self.engines.pop(k, None)
            if engine is not None:
                engine.shutdown()


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: hosts the group's store, then per update broadcasts every layer while the engine receives."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client, source: WeightSource, is_sender: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group = None
        self.timeout_s = timeout_s

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source: WeightSource | None = None):
        if source is None:
            raise ValueError("the gloo trainer weight transfer needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, timeout_s=init_info.timeout_s)
        if not engine.is_sender:
            return engine
        store = dist.TCPStore(init_info.master_address, init_info.master_port, init_info.world_size, is_master=True,
                              wait_for_workers=False, timeout=datetime.timedelta(seconds=init_info.timeout_s))
        worker = GlooInitInfo(init_info.master_address, store.port, init_info.world_size, 1, init_info.timeout_s)
        # The engine blocks in its init until the group is complete, and so does this side: both run at once, and an
        # engine that refuses (built without the backend, say) fails this call at once, not after the timeout.
        box: dict = {}
        call = _Call(engine.client.init_weight_transfer_engine, asdict(worker))
        opener = _Call(lambda: box.setdefault("group", _group(init_info.master_address, store.port, 0,
                                                              init_info.world_size, init_info.timeout_s, store)))
        while not (call.done and opener.done):
            call.raise_if_failed()
            opener.result(timeout=0.2, missing_ok=True)
        call.result()
        engine.group = box["group"]
        return engine

    def send_weights(self) -> None:
        source = self.source
        groups = source.groups()
        meta = {m.name: m for m in source.metadata()}
        if not self.is_sender:  # materialising is a collective (FSDP full_tensor): every rank iterates in lockstep
            for _ in source.iter_groups():
                pass
            return
        ordered = [meta[n] for g in groups for n in g]
        info = GlooUpdateInfo(names=[m.name for m in ordered],
                              dtype_names=[str(m.dtype).removeprefix("torch.") for m in ordered],
                              shapes=[list(m.shape) for m in ordered], group_sizes=[len(g) for g in groups])
        self.client.start_weight_update()
        call = _Call(self.client.update_weights, asdict(info))
        for names, tensors in source.iter_groups():
            call.raise_if_failed()  # the engine refused before receiving: do not wait out a broadcast timeout
            for n, t in zip(names, tensors):
                m = meta[n]
                if t.dtype != m.dtype or tuple(t.shape) != m.shape:
                    raise ValueError(f"weight source: {n} is {t.dtype} {tuple(t.shape)}, metadata said "
                                     f"{m.dtype} {m.shape}")
            _broadcast(self.group, torch.cat([_as_bytes(t.cpu()) for t in tensors]))
        call.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.group = None


class _Call:
    """A control-plane call on a daemon thread (it blocks until the data plane completes; a failed transfer must not
    leave a thread that keeps the interpreter from exiting)."""

    def __init__(self, fn, *args):
        self._error: BaseException | None = None
        self._done = threading.Event()

        def run():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
                self._error = e
            finally:
                self._done.set()

        threading.Thread(target=run, daemon=True, name="weight-transfer-rpc").start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def raise_if_failed(self) -> None:
        if self._done.is_set() and self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None, missing_ok: bool = False) -> None:
        """Wait for the call and re-raise its error; ``missing_ok``: a call still running after ``timeout`` is not
        an error (the caller polls)."""
        if not self._done.wait(timeout):
            if missing_ok:
                return
            raise TimeoutError("the engine side of the weight transfer did not finish")
        if self._error is not None:
            raise self._error


class PolicyClient:
    """``VLLMWeightSyncClient`` for a :class:`~agentenv.samplers.vllm_policy.VLLMPolicy` in this process (a Ray
    actor's client forwards the same four calls to the actor). ``version`` is what :meth:`finish_weight_update` sets
    the policy to; vLLM's ``weight_version`` string is not used (the loop's versions are integers)."""

    def __init__(self, policy, version: int | None = None):
        self.policy, self.version = policy, version

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.policy.init_weight_transfer(init_info)

    def start_weight_update(self) -> None:
        self.policy.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.policy.receive_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.policy.finish_weight_update(self.version)


def trainer_engine(transport: str, client, source: WeightSource, *, master_address: str = "127.0.0.1",
                   world_size: int = 2, rank: int = 0):
    """Open the trainer side of ``transport`` (gloo / nccl / ipc) against one engine's ``client``: phase 2 of 4 (the
    client's ``init_weight_transfer_engine`` is phase 1). Every trainer rank calls it; ``rank`` 0 is the sender
    (it alone opens the group and calls the client), the others only join the gathers when weights are sent."""
    if transport == "gloo":
        info = GlooTrainerInitInfo(rank=rank, master_address=master_address, world_size=world_size)
    elif transport == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(master_address, _free_port() if rank == 0 else 0, world_size, rank=rank)
    elif transport == "ipc":
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        info = IPCTrainerInitInfo(rank=rank)
    else:
        raise ValueError(f"no weight-transfer engine for transport {transport!r}")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


_REGISTER_LOCK = threading.Lock()


def register() -> None:
    """Register the gloo pair in vLLM's registries (``register_engine`` raises on a second registration)."""
    with _REGISTER_LOCK:
        if "gloo" not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)
        if "gloo" not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerWeightTransferEngine)


register()
