"""Trajectories: the record a rollout produces and a learner consumes, plus a versioned JSONL format.

Contract (one object per trajectory):

* ``token_ids``: ONE flat token sequence -- the rendered prompt, then every assistant turn and every observation /
  tool-result turn, appended in order. It is built by appending chat-template deltas; the history is never
  re-tokenized (see :mod:`agentenv.core.chat`).
* ``action_mask[t]``: True exactly on tokens the policy sampled (including the end-of-turn token it sampled); False
  on system / user prompt, observation and tool-output tokens and on template glue.
* ``behavior_logprobs[t]``: log mu(token_t) under the distribution the sampler actually drew from (after
  temperature, top-p, top-k); 0.0 wherever ``action_mask`` is False.
* ``policy_version[t]``: version of the weights that sampled token t; -1 wherever ``action_mask`` is False.
* ``reward``, ``success``, ``terminated``, ``truncated``, ``finish_reason`` (one of :data:`FINISH_REASONS`),
  ``num_turns``, ``num_tool_calls`` (well-formed ``<tool_call>`` blocks: a JSON object naming a tool, whether or not
  the call then failed), ``num_tool_errors`` (well-formed calls that failed: unknown tool, bad arguments, the tool
  raising, timeout), ``num_tool_timeouts``, ``num_tool_malformed`` (blocks that could not be parsed as a call; not in
  ``num_tool_calls``), ``tool_calls_by_name`` / ``tool_errors_by_name`` (``{tool name: count}``),
  ``num_invalid_actions``,
  ``messages`` (the human-readable chat), ``tools`` (schemas shown to the model), ``sampling`` (temperature, top_p,
  top_k, max_new_tokens, and ``backend``: the sampler that drew the tokens -- ``"hf"``, ``"vllm"``, ``"endpoint"``
  (a served model, text only) or ``"text"`` for non-LLM policies), ``model`` and ``model_path``, ``env``, ``task``, ``task_type``, ``segments`` (start offsets of
  token segments; more than one only where a chat template was not append-only and a new segment was started).

All four per-token lists have the same length. Text-policy trajectories (scripted experts) have empty token lists.

The JSONL file format is versioned by a ``schema_version`` field in every line. :func:`read_jsonl` reads the current
version and every older one it knows how to upgrade; anything else is a clear error. The writers flush whole lines,
so a crash can only leave the LAST line cut short (no final newline): the reader skips that one line with a
:class:`TruncatedLineWarning` and keeps everything before it. A bad line anywhere else is an error. History:

* 1: first released format.
* 2: ``num_tool_malformed``, ``tool_calls_by_name``, ``tool_errors_by_name``; ``num_tool_calls`` / ``num_tool_errors``
  count well-formed calls only; finish reasons ``template_error`` and ``generation_budget``. A version-1 record is
  read with the new fields empty; its ``num_tool_calls`` still includes malformed blocks (they cannot be told apart
  after the fact), which ``meta["upgraded_from"] == 1`` makes visible.
"""

from __future__ import annotations

import json
import logging
import lzma
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Iterable, Iterator

SCHEMA_VERSION = 2

FINISH_REASONS = (
    "done",  # the env ended the episode (task solved or failed)
    "max_turns",  # the runtime's turn limit
    "context_limit",  # the next turn would not fit in max_total_tokens
    "max_new_tokens",  # an assistant turn hit max_new_tokens without ending its turn
    "invalid_action_budget",  # the env's invalid-action budget ran out
    "env_error",  # env.reset/step raised; what was collected is kept
    "policy_error",  # the sampler raised; what was collected is kept
    "template_error",  # the chat template failed or rewrote history (on_rewrite="error"); what was collected is kept
    "generation_budget",  # the sampled tokens summed over turns reached max_generated_tokens
)


@dataclass
class Trajectory:
    env: str = ""
    task: str = ""
    task_type: str | None = None
    model: str = ""
    model_path: str | None = None
    sampling: dict = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[bool] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)
    segments: list[int] = field(default_factory=lambda: [0])
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    reward: float = 0.0
    success: bool = False
    terminated: bool = False
    truncated: bool = False
    finish_reason: str = "done"
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_tool_timeouts: int = 0
    num_tool_malformed: int = 0
    tool_calls_by_name: dict = field(default_factory=dict)
    tool_errors_by_name: dict = field(default_factory=dict)
    num_invalid_actions: int = 0
    tool_call_before_answer: bool = False
    error: str | None = None
    wall_time_s: float = 0.0
    time_generation_s: float = 0.0
    time_env_s: float = 0.0
    id: str = ""
    meta: dict = field(default_factory=dict)

    # --- derived ------------------------------------------------------------------------------------------------
    @property
    def num_policy_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def versions(self) -> list[int]:
        """Distinct policy versions that sampled this trajectory's tokens (sorted)."""
        return sorted({v for v, m in zip(self.policy_version, self.action_mask) if m})

    def validate(self) -> None:
        """Raise ValueError if the per-token fields break the contract."""
        n = len(self.token_ids)
        for name in ("action_mask", "behavior_logprobs", "policy_version"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries but token_ids has {n}")
        for t, (m, lp, v) in enumerate(zip(self.action_mask, self.behavior_logprobs, self.policy_version)):
            if m:
                if not (math.isfinite(lp) and lp <= 0.0):
                    raise ValueError(f"behavior_logprobs[{t}]={lp} on a sampled token must be finite and <= 0")
                if v < 0:
                    raise ValueError(f"policy_version[{t}]={v} on a sampled token must be >= 0")
            elif lp != 0.0:
                raise ValueError(f"behavior_logprobs[{t}]={lp} must be 0.0 on a non-sampled token")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward must be finite, got {self.reward}")

    # --- (de)serialisation --------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["schema_version"] = SCHEMA_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        d = _upgrade(dict(d))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"schema_version"})
        if unknown:
            raise ValueError(f"trajectory record has unknown fields {unknown} (schema_version {SCHEMA_VERSION})")
        return cls(**{k: v for k, v in d.items() if k in known})


def _upgrade(d: dict) -> dict:
    """Bring a record of an older schema version up to :data:`SCHEMA_VERSION`, or fail clearly."""
    version = d.get("schema_version")
    if version is None:
        raise ValueError("trajectory record has no schema_version; it was not written by agentenv")
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise ValueError(
            f"trajectory record has schema_version {version!r}, newer than this agentenv understands "
            f"({SCHEMA_VERSION}); upgrade agentenv to read it"
        )
    if version < 1:
        raise ValueError(f"trajectory schema_version {version} predates the first released format (1)")
    if version == 1:  # 1 -> 2: new tool counters start empty (see the module docstring)
        d["meta"] = {**(d.get("meta") or {}), "upgraded_from": 1}
        d["schema_version"] = 2
    return d


def write_jsonl(path: str | os.PathLike, trajectories: Iterable[Trajectory], *, append: bool = False) -> int:
    """Write trajectories one JSON object per line. Returns the number written. Flushes each line so a crash
    loses at most the line being written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for traj in trajectories:
            f.write(json.dumps(traj.to_dict(), ensure_ascii=False) + "\n")
            f.flush()
            n += 1
    return n


class JsonlWriter:
    """Append-as-you-go writer for long runs (one line per finished trajectory, flushed)."""

    def __init__(self, path: str | os.PathLike, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")
        self.count = 0

    def write(self, traj: Trajectory) -> None:
        self._f.write(json.dumps(traj.to_dict(), ensure_ascii=False) + "\n")
        self._f.flush()
        self.count += 1

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "JsonlWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TruncatedLineWarning(UserWarning):
    """The last line of a trajectory file was cut short (a crash while it was written) and was skipped."""


def iter_jsonl(path: str | os.PathLike) -> Iterator[Trajectory]:
    """Trajectories from a JSONL file, read lazily; ``*.xz`` files (e.g. the shipped expert demos) are decompressed
    on the fly."""
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                d = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                if not raw.endswith(b"\n"):  # only the last line can lack its newline: cut short by a crash
                    msg = (f"{path}:{lineno}: the last line is cut short ({len(raw)} bytes; {e}); skipped it, kept "
                           f"the {lineno - 1} lines before")
                    warnings.warn(msg, TruncatedLineWarning, stacklevel=2)
                    logging.getLogger(__name__).warning(msg)
                    return
                why = e.msg if isinstance(e, json.JSONDecodeError) else f"not UTF-8: {e.reason}"
                raise ValueError(f"{path}:{lineno}: not valid JSON ({why})") from None
            try:
                yield Trajectory.from_dict(d)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None


def read_jsonl(path: str | os.PathLike) -> list[Trajectory]:
    return list(iter_jsonl(path))
