"""No silent non-learning: say so, once, when a run's updates stop moving the policy.

Contract:

* :class:`NoLearningWatch` ``(updates=K)`` reads each per-update record (:func:`agentenv.core.metrics.update_record`):
  ``optimizer_step_skipped`` (the learner took no optimizer step: every advantage was zero or the trust gate
  admitted nothing, :mod:`agentenv.trainer.learner`) and ``reward_min`` / ``reward_max`` (the batch's rewards).
  After K consecutive updates in which the step was skipped OR every reward of the batch was equal, it logs ONE
  warning naming the reason and the fix, and :meth:`observe` returns it (``None`` otherwise). It does not re-arm:
  one warning per run is the message, not a stream.
* Reasons, most specific first: every reward 0 ("the model never reaches a reward": warm-start it with
  ``agentenv sft``), every reward equal to some other value (every sample solved it, or a constant reward: nothing
  to rank), the optimizer step skipped with varied rewards (the trust gate admitted nothing: check
  ``acceptance_rate``).
* :func:`step_counts(records)` -> ``{"optimizer_steps": taken, "optimizer_steps_skipped": skipped}`` over a run's
  update records (``agentenv run`` writes them into ``summary.json``).
"""

from __future__ import annotations

import logging

log = logging.getLogger("agentenv.core.stall")

FIX_ZERO = ("warm-start it with `agentenv sft --env ENV --demos FILE.jsonl` (README: 'Writing a new tool environment'; "
            "docs/tool_envs.md) or give partial credit")


def _reason(recs: list[dict], k: int) -> str:
    lows = {r.get("reward_min") for r in recs}
    highs = {r.get("reward_max") for r in recs}
    equal = all(r.get("reward_min") is not None and r.get("reward_min") == r.get("reward_max") for r in recs)
    if equal and lows == highs == {0.0}:
        return (f"every reward in the last {k} batches is 0: the model never reaches a reward, so there is nothing to "
                f"learn from; {FIX_ZERO}")
    if equal:
        return (f"every trajectory in each of the last {k} batches got the same reward "
                f"({', '.join(f'{v:g}' for v in sorted(lows))}): REINFORCE advantages are zero, nothing to rank; "
                "use harder tasks (every sample solves these) or a reward that tells attempts apart")
    return (f"the last {k} updates took no optimizer step although rewards varied: the trust gate admitted nothing "
            "(see acceptance_rate); check algo.loss.delta and the sampling settings (agentenv run --dry-run)")


class NoLearningWatch:
    def __init__(self, updates: int = 5):
        if updates < 1:
            raise ValueError(f"updates must be >= 1, got {updates}")
        self.updates = updates
        self._run: list[dict] = []
        self.warned: str | None = None

    def observe(self, rec: dict) -> str | None:
        equal = rec.get("reward_min") is not None and rec.get("reward_min") == rec.get("reward_max")
        if not (rec.get("optimizer_step_skipped") or equal):
            self._run = []
            return None
        self._run = (self._run + [rec])[-self.updates:]
        if self.warned is not None or len(self._run) < self.updates:
            return None
        self.warned = _reason(self._run, self.updates)
        log.warning("NO LEARNING: %s", self.warned)
        return self.warned


def step_counts(records: list[dict]) -> dict:
    skipped = sum(int(bool(r.get("optimizer_step_skipped"))) for r in records)
    return {"optimizer_steps": len(records) - skipped, "optimizer_steps_skipped": skipped}
