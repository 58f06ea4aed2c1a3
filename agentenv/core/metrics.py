"""Per-update training metrics: computed from each batch, written to JSONL + TensorBoard (+ W&B), one log line.

Contract:

* :func:`batch_metrics(trajectories)` -> the trajectory-side numbers of one update (see :data:`METRIC_HELP`).
  The same function summarises ``agentenv rollout`` and every evaluation.
* :func:`update_record(...)` -> THE per-update record, built in one place by the loop from the batch statistics,
  the batch's lag, the learner's stats, the accounting counters and the timings (no renaming, no second copy).
* :class:`MetricsLogger` is the run's one sink: it appends each record to ``RUN_DIR/metrics.jsonl`` (one file per
  run; events such as the shutdown summary are rows with an ``event`` key), writes TensorBoard scalars to
  ``RUN_DIR/tb/`` and W&B when enabled and installed, and prints ONE short greppable line per update starting with
  ``[update N]``.
* Tool-call collapse alarm: with ``peak`` = the highest tool share (trajectories with >= 1 tool call) over the last
  ``window`` updates and ``now`` the mean of the last 3, it warns ``TOOL-CALL COLLAPSE`` once ``now < ratio * peak``
  (and peak >= 0.2), and sets ``tool_collapse_alarm`` = 1 in that update's metrics. It re-arms after recovery.
* Malformed-call alarm: when the mean of ``tool_malformed_mean`` over the last 3 updates reaches
  ``malformed_alarm`` (0.3 unparseable ``<tool_call>`` blocks per trajectory), it warns ``TOOL-CALL FORMAT BREAKING``
  once and sets ``malformed_call_alarm`` = 1; it re-arms after recovery. The policy losing the call format comes
  before the tool-call rate falls (the CPU demo: 0.1 -> 0.9 -> 1.4 malformed blocks in 3 updates, then no reward).
* No-learning alarm (:mod:`agentenv.core.stall`): ``no_learning_updates`` updates in a row without an optimizer step or
  with every reward of the batch equal warn once with the reason and the fix (``no_learning_alarm`` = 1 then).
"""

from __future__ import annotations

import json
import logging
import math
from collections import deque
from pathlib import Path
from typing import Sequence

from agentenv.core.trajectory import Trajectory

log = logging.getLogger("agentenv.core.metrics")

METRIC_HELP: dict[str, str] = {
    "reward_mean": "mean reward of the trajectories in the update's batch",
    "success_rate": "share of the batch that solved its task (success_<type>: the same per task type)",
    "tool_calls_mean": "well-formed tool calls per trajectory (failed calls count; malformed blocks do not)",
    "tool_malformed_mean": "<tool_call> blocks per trajectory that could not be parsed as a call",
    "tool_calls/<name>": "calls of tool <name> per trajectory (tool_errors/<name>: its failed calls)",
    "tool_call_rate": "the tool-call rate: share of trajectories with at least one well-formed tool call (the collapse alarm watches it)",
    "tool_error_rate": "failed tool calls / tool calls (malformed call, unknown tool, crash, timeout, limit hit)",
    "tool_timeout_rate": "timed-out tool calls / tool calls",
    "turns_mean": "assistant turns per trajectory",
    "policy_tokens_mean": "policy-sampled tokens per trajectory (the tokens the loss trains)",
    "tokens_mean": "all tokens per trajectory (prompt, observations, tool outputs, policy tokens)",
    "truncation_rate": "share of trajectories cut by a limit (turns, context, max new tokens) -- never success",
    "acceptance_rate": "share of the batch the sequence trust gate admitted (mean sampled-token KL <= delta)",
    "seq_kl_mean": "per-trajectory mean sampled-token Bernoulli KL(mu || pi), averaged over the batch (seq_kl_max: max)",
    "lag_mean": "policy lag in versions: learner version minus the versions that sampled the tokens (lag_max: worst)",
    "ratio_mean": "token importance ratio pi/mu over retained tokens (ratio_min / ratio_max: extremes)",
    "entropy_mean": "mean entropy of the current policy on sampled tokens (when computed)",
    "grad_norm": "gradient norm before clipping",
    "lr": "learning rate used for the update",
    "loss": "the surrogate loss value (its gradient is the estimator; the value itself has no meaning to optimise)",
    "traj_per_s": "trajectories consumed per second of run time",
    "tokens_per_s": "trajectory tokens consumed per second of run time",
    "time_generation_s": "seconds sampling this batch's turns (summed over its trajectories)",
    "time_env_s": "seconds in env reset/step for this batch, tool execution included",
    "time_learner_s": "seconds of the learner's update",
    "started/trained/rejected/dropped/interrupted": "trajectory accounting: every started trajectory ends in one bucket",
    "accounting_balance": "started minus all buckets: must be 0",
}


def batch_metrics(trajs: Sequence[Trajectory]) -> dict:
    n = max(1, len(trajs))
    calls = sum(t.num_tool_calls for t in trajs)  # well-formed calls (trajectory schema 2)
    m = {
        "reward_mean": sum(t.reward for t in trajs) / n,
        "success_rate": sum(bool(t.success) for t in trajs) / n,
        "tool_calls_mean": calls / n,
        "tool_call_rate": sum(t.num_tool_calls > 0 for t in trajs) / n,
        "tool_malformed_mean": sum(t.num_tool_malformed for t in trajs) / n,
        "tool_error_rate": sum(t.num_tool_errors for t in trajs) / calls if calls else 0.0,
        "tool_timeout_rate": sum(t.num_tool_timeouts for t in trajs) / calls if calls else 0.0,
        "answer_after_tool": sum(bool(t.tool_call_before_answer) for t in trajs) / n,
        "turns_mean": sum(t.num_turns for t in trajs) / n,
        "policy_tokens_mean": sum(t.num_policy_tokens for t in trajs) / n,
        "tokens_mean": sum(len(t.token_ids) for t in trajs) / n,
        "tokens": sum(len(t.token_ids) for t in trajs),
        "truncation_rate": sum(bool(t.truncated) for t in trajs) / n,
        "invalid_actions_mean": sum(t.num_invalid_actions for t in trajs) / n,
        "template_error_rate": sum(t.finish_reason == "template_error" for t in trajs) / n,
    }
    for field, prefix in (("tool_calls_by_name", "tool_calls"), ("tool_errors_by_name", "tool_errors")):
        per_tool: dict[str, int] = {}
        for t in trajs:
            for name, k in getattr(t, field).items():
                per_tool[name] = per_tool.get(name, 0) + k
        for name, k in sorted(per_tool.items()):
            m[f"{prefix}/{name}"] = k / n
    by_type: dict[str, list[bool]] = {}
    for t in trajs:
        if t.task_type:
            by_type.setdefault(str(t.task_type), []).append(bool(t.success))
    for k, v in sorted(by_type.items()):
        m[f"success_{k}"] = sum(v) / len(v)
    return m


# Learner stats that the record states once elsewhere (the batch statistics, the loop's version and lag).
_LEARNER_SKIP = {"admitted", "reward_mean", "step", "policy_version", "policy_lag_mean", "policy_lag_max",
                 "num_trajectories"}


def update_record(*, update: int, policy_version: int, mode: str, batch: Sequence[Trajectory],
                  lags: Sequence[tuple[float, int]], learner_stats: dict, counters: dict, timings: dict) -> dict:
    """THE per-update metrics record, built in one place: batch statistics of the trajectories
    (:func:`batch_metrics`), the batch's lag (one definition: :func:`agentenv.trainer.accounting.trajectory_lag`),
    the learner's scalar stats under their own names, the accounting counters, and the timings."""
    rec: dict = {"update": update, "policy_version": policy_version, "mode": mode, "batch_size": len(batch)}
    rec.update(batch_metrics(batch))
    rec["reward_min"] = min((t.reward for t in batch), default=0.0)  # equal to reward_max: nothing to rank (stall)
    rec["reward_max"] = max((t.reward for t in batch), default=0.0)
    rec["lag_mean"] = sum(lm for lm, _ in lags) / max(1, len(lags))
    rec["lag_max"] = max((lx for _, lx in lags), default=0)
    rec["versions_per_traj_max"] = max((len(t.versions) for t in batch), default=0)
    for k, v in learner_stats.items():
        if k in _LEARNER_SKIP or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        rec[f"learner_{k}" if k in rec else k] = v
    rec.update(counters)
    rec.update(timings)
    return rec


class MetricsLogger:
    def __init__(self, run_dir: str | Path | None, *, tensorboard: bool = True, wandb: bool = False,
                 collapse_window: int = 20, collapse_ratio: float = 0.3, config: dict | None = None,
                 echo=print, no_learning_updates: int = 5, malformed_alarm: float = 0.3):
        from agentenv.core.stall import NoLearningWatch

        self.run_dir = Path(run_dir) if run_dir else None
        self.echo = echo
        self.history: list[dict] = []
        self.window = deque(maxlen=collapse_window)
        self.collapse_ratio = collapse_ratio
        self._alarmed = False
        self.malformed_alarm, self._malformed = malformed_alarm, deque(maxlen=3)
        self._malformed_alarmed = False
        self.stall = NoLearningWatch(no_learning_updates)  # warns once: K updates in a row that cannot learn
        self._tokens_total = 0
        self._f = self._tb = self._wandb = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._f = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter

                    self._tb = SummaryWriter(str(self.run_dir / "tb"))
                except ImportError as e:  # tensorboard is a base dependency; degrade rather than die
                    log.warning("TensorBoard unavailable (%s); metrics go to JSONL only", e)
        if wandb:
            try:
                import wandb as _wandb

                self._wandb = _wandb.init(project="agentenv", config=config or {},
                                          dir=str(self.run_dir) if self.run_dir else None)
            except ImportError:
                log.info("wandb not installed; skipping W&B logging")

    def reopen(self) -> None:
        """Reopen ``metrics.jsonl`` after someone replaced the file (a resumed run reconciles it first)."""
        if self._f is not None:
            self._f.close()
            self._f = open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 -- run-long

    # --- per update ---------------------------------------------------------------------------------------------
    def log_update(self, record: dict) -> dict:
        m = dict(record)
        self._tokens_total += int(m.get("tokens", 0))
        if m.get("elapsed_s"):
            m["tokens_per_s"] = self._tokens_total / m["elapsed_s"]
        m["tool_collapse_alarm"] = int(self._collapse_check(m.get("tool_call_rate")))
        m["malformed_call_alarm"] = int(self._malformed_check(m.get("tool_malformed_mean")))
        m["no_learning_alarm"] = int(self.stall.observe(m) is not None)
        self.history.append(m)
        step = int(m.get("update", len(self.history)))
        if self._f is not None:
            self._f.write(json.dumps(m) + "\n")
            self._f.flush()
        scalars = {k: float(v) for k, v in m.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(f"train/{k}", v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"train/{k}": v for k, v in scalars.items()}, step=step)
        if self.echo is not None:
            self.echo(format_line(m))
        return m

    def _collapse_check(self, share) -> bool:
        if share is None:
            return False
        self.window.append(float(share))
        peak = max(self.window)
        recent = list(self.window)[-3:]
        now = sum(recent) / len(recent)
        collapsed = len(self.window) >= 3 and peak >= 0.2 and now < self.collapse_ratio * peak
        if collapsed and not self._alarmed:
            log.warning("TOOL-CALL COLLAPSE: tool-call rate %.2f is below %.0f%% of its recent peak %.2f (last %d "
                        "updates). The policy is learning to answer without tools -- the failure the paper reports for "
                        "GRPO. Check the reward (does the tool pay?), the trust gate (acceptance_rate) and lr.",
                        now, 100 * self.collapse_ratio, peak, len(self.window))
        self._alarmed = collapsed
        return collapsed

    def _malformed_check(self, malformed) -> bool:
        if malformed is None:
            return False
        self._malformed.append(float(malformed))
        now = sum(self._malformed) / len(self._malformed)
        breaking = len(self._malformed) == 3 and now >= self.malformed_alarm
        if breaking and not self._malformed_alarmed:
            log.warning("TOOL-CALL FORMAT BREAKING: %.2f unparseable <tool_call> blocks per trajectory over the last 3 "
                        "updates (alarm at %.2f). The policy is losing the call format; runs that lost it for good "
                        "went to every reward 0 within a few updates. Check acceptance_rate and kl (a step too "
                        "large for the gate), and lower algo.lr if it recurs.", now, self.malformed_alarm)
        self._malformed_alarmed = breaking
        return breaking

    def log_event(self, event: str, **fields) -> None:
        """A non-update row (e.g. the shutdown summary); :func:`read_metrics` skips it."""
        if self._f is not None:
            self._f.write(json.dumps({"event": event, **fields}, default=str) + "\n")
            self._f.flush()

    def log_eval(self, step: int, name: str, summary: dict) -> None:
        rec = {"event": "eval", "update": step, "split": name, **summary}
        if self.run_dir is not None:
            with open(self.run_dir / "eval.jsonl", "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in summary.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"eval/{name}/{k}", float(v), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({f"eval/{name}/{k}": v for k, v in summary.items() if isinstance(v, (int, float))}, step=step)
        if self.echo is not None:
            self.echo(f"[eval update={step} split={name}] " + " ".join(
                f"{k}={_fmt(v)}" for k, v in summary.items() if isinstance(v, (int, float))))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


# The log line: what a person scans while a run goes; everything else is in metrics.jsonl / TensorBoard.
LINE_KEYS = (("reward_mean", "reward"), ("success_rate", "success"), ("tool_call_rate", "tool_call_rate"),
             ("policy_tokens_mean", "len"), ("acceptance_rate", "accept"), ("seq_kl_mean", "kl"),
             ("lag_mean", "lag"), ("grad_norm", "gnorm"), ("lr", "lr"), ("traj_per_s", "traj/s"),
             ("time_learner_s", "t_learn"), ("dropped", "dropped"))


def format_line(m: dict) -> str:
    parts = [f"[update {m.get('update', '?')}]"]
    for key, short in LINE_KEYS:
        if key in m:
            parts.append(f"{short}={_fmt(m[key])}")
    if m.get("tool_collapse_alarm"):
        parts.append("ALARM=tool_collapse")
    if m.get("malformed_call_alarm"):
        parts.append("ALARM=malformed_calls")
    return " ".join(parts)


def _fmt(v) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.3g}" if abs(v) < 1e-2 and v != 0 else f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The per-update records of a run (skips events and rows of updates a crash rolled back)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {run_dir} a run directory?")
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if "event" in rec or "update" not in rec or rec.get("rolled_back"):
            continue
        if "tool_share" in rec:  # the tool-call rate's name in runs written before it was named tool_call_rate
            rec.setdefault("tool_call_rate", rec.pop("tool_share"))
        out.append(rec)
    return out
