"""Continuous serving for :class:`.vllm_policy.VLLMPolicy`: each request enters the running engine when it is asked
for and is answered as soon as it finishes, so one episode's next turn never waits for other episodes' turns.

Contract:

* :meth:`ContinuousServing.submit` ``(request) -> Future[Generation]`` queues one request and returns at once. One
  serving thread (started when there is work, gone when there is none) admits queued requests into vLLM's v1
  ``LLMEngine`` (``add_request``) between engine steps and runs ``step()`` while any is in flight; the step that
  finishes a request resolves its future. vLLM's scheduler batches whatever is in flight at each step (continuous
  batching), so a request submitted while others generate joins them at the next step. This is the library's own
  offline mechanism (``LLM.generate`` is ``add_request`` for each prompt, then ``step()`` until all finish) with
  requests added while it runs; vLLM's ``AsyncLLM`` always runs its engine in another process, which would send every
  weight update through serialisation and puts a second process inside each Ray actor.
* :meth:`generate` ``(batch)`` submits every request (its seeds drawn in order, admitted together) and waits for all.
* Weights and memory: every engine call other than the serving thread's (a weight load, the transfer phases, sleep)
  first pauses admission and waits until nothing is in flight (:meth:`_idle`), then runs while no request can
  enter (wake-up runs only on a sleeping engine, where nothing is in flight). So every request runs start to finish
  on one weight version, the one its ``Generation`` reports (taken when it was admitted), its future is resolved
  before any weight change starts, and ``policy_version`` moves only once the engine holds the new weights and no
  request is running. Requests submitted meanwhile queue and are admitted once the engine is free again (after the
  load, after ``finish_weight_update``, after :meth:`wake_up`).
* A request's own failure (vLLM refuses its prompt, its log-probs do not align) fails its future only. A failure of
  an engine step marks the policy unusable (as a failed weight load does) and fails every queued and running request.
* A future's done-callbacks run on the serving thread: they must not wait for the policy.
* Cancelling a future (``Future.cancel()``, e.g. :class:`agentenv.core.serving.PerRequest` when a rollout stops)
  withdraws a request that is still queued; an admitted request runs to its end.

Only the serving thread touches the engine while a request is in flight, and only a caller holding the policy's
condition with nothing in flight touches it otherwise: vLLM's engine is not thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from concurrent.futures import Future
from typing import Sequence

from agentenv.core.policy import Generation, GenerationRequest


class ContinuousServing:
    """Mixin: requests served continuously on the policy's engine (see the module docstring). Reads the policy's
    ``llm``, ``_cond``, ``_updating``, ``_asleep``, ``_broken``, ``policy_version``, ``_TokensPrompt``,
    ``_vllm_params`` and ``_to_generation``."""

    def _init_serving(self) -> None:
        self._pending: deque = deque()  # (request, future, vLLM sampling params) not yet admitted
        self._inflight: dict[str, tuple] = {}  # request id -> (request, future, version at admission)
        self._draining = 0  # callers waiting for the engine to empty (admission paused meanwhile)
        self._serving = False  # the serving thread runs
        self._ids = itertools.count()

    def submit(self, request: GenerationRequest) -> Future:
        """Queue one request; its future resolves to the :class:`Generation` as soon as the engine finishes it."""
        return self._submit([request])[0]

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        return [f.result() for f in self._submit(requests)]

    def _submit(self, requests: Sequence[GenerationRequest]) -> list[Future]:
        for r in requests:
            if not r.prompt_ids:
                raise ValueError("empty prompt")
        futures = [Future() for _ in requests]
        with self._cond:
            self._check_usable()
            # Seeds are drawn here, in submission order: the same sequence of calls gives the same draws.
            self._pending.extend((r, f, self._vllm_params(r)) for r, f in zip(requests, futures))
            if not self._serving and requests:
                self._serving = True
                threading.Thread(target=self._serve, name="agentenv-vllm-serve", daemon=True).start()
            self._cond.notify_all()
        return futures

    @property
    def in_flight(self) -> int:
        """Requests admitted into the engine and not yet finished."""
        return len(self._inflight)

    @property
    def admitting(self) -> bool:
        """False while a weight load, a transfer update or sleep holds new requests back (they queue)."""
        return self._admissible()

    def _admissible(self) -> bool:
        return not (self._asleep or self._updating or self._draining or self._broken is not None)

    def _idle(self) -> None:
        """(Holding the condition) pause admission, wait until no request is in flight and no transfer update is
        open; then refuse a broken engine. The caller then uses the engine before releasing the condition (or leaves
        it in a state that keeps admission paused: ``_updating``, ``_asleep``)."""
        self._draining += 1
        try:
            self._cond.wait_for(lambda: not (self._updating or self._inflight) or self._broken is not None)
        finally:
            self._draining -= 1
            self._cond.notify_all()  # the serving thread re-checks once the caller releases the condition
        self._check_usable()

    # --- the serving thread -----------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._inflight or not self._pending or self._admissible()
                                    or self._broken is not None)
                if self._broken is not None:
                    self._fail_all(RuntimeError(f"this vLLM engine can no longer be used: {self._broken}"))
                if not (self._pending or self._inflight):
                    self._serving = False  # the next submit starts a new thread
                    return
                admitted = self._admit() if self._admissible() else []
            try:
                self._add(admitted)
                finished = [o for o in self.llm.llm_engine.step() if o.finished] if self._inflight else []
            except BaseException as e:  # noqa: BLE001 -- the engine's state is unknown: nobody samples from it again
                with self._cond:
                    self._broken = f"a vLLM engine step failed ({type(e).__name__}: {e})"
                    self._cond.notify_all()
                continue
            for out in finished:
                req, fut, version = self._inflight[out.request_id]  # only this thread changes _inflight
                # Resolved while still counted in flight: its caller has it before any weight change can start.
                self._resolve(fut, lambda: self._to_generation(req, out, version))
                with self._cond:
                    del self._inflight[out.request_id]
                    if not self._inflight:
                        self._cond.notify_all()  # a weight load / sleep may be waiting for the engine to empty

    def _admit(self) -> list[tuple]:
        """(Holding the condition) move every queued request in flight, at the current weight version."""
        admitted = []
        while self._pending:
            req, fut, params = self._pending.popleft()
            if fut.set_running_or_notify_cancel():  # False: cancelled while queued, never reaches the engine
                rid = f"agentenv-{next(self._ids)}"
                self._inflight[rid] = (req, fut, self.policy_version)
                admitted.append((rid, req, params))
        return admitted

    def _add(self, admitted: list[tuple]) -> None:
        for rid, req, params in admitted:
            try:
                # The prompt rendered as LLM.generate renders it (token ids in, nothing re-tokenized).
                prompt = self.llm._preprocess_cmpl_one(self._TokensPrompt(prompt_token_ids=list(req.prompt_ids)))
                self.llm.llm_engine.add_request(rid, prompt, params)
            except Exception as e:  # noqa: BLE001 -- vLLM refused this request (e.g. too long): it alone fails
                with self._cond:
                    _, fut, _ = self._inflight.pop(rid)
                    if not self._inflight:
                        self._cond.notify_all()
                fut.set_exception(e)

    @staticmethod
    def _resolve(fut: Future, make) -> None:
        try:
            fut.set_result(make())
        except Exception as e:  # noqa: BLE001 -- e.g. LogprobAlignmentError: this request's caller sees it
            fut.set_exception(e)

    def _fail_all(self, error: BaseException) -> None:
        """(Holding the condition) fail every queued and running request (the engine is broken)."""
        while self._pending:
            _, fut, _ = self._pending.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
        for _, fut, _ in self._inflight.values():
            fut.set_exception(error)
        self._inflight.clear()
        self._cond.notify_all()
