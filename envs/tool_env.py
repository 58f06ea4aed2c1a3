"""ToolEnv: a multi-turn question-answering environment in which the policy may call tools before answering.

Contract (on top of :mod:`agentenv.envs.base`):

* ``ToolEnv(tasks, tools, grader=..., system_prompt=..., max_turns=10)``. ``tasks`` are :class:`Task` objects,
  mappings with ``question`` / ``answer`` (and optional ``id`` / ``type``), or a path to a JSONL / Parquet file.
  ``tools`` are :class:`~agentenv.envs.tools.Tool` objects or plain typed, documented functions.
* ``reset(seed=, options=)`` picks a task: ``options={"task_index": i}`` or ``{"task_id": "..."}`` chooses one
  (to evaluate a whole set), otherwise it is drawn from the env's seeded RNG. The observation is the question
  (a ``"user"`` message); ``info`` has ``"system"``, ``"tools"`` (OpenAI function schemas for the chat template),
  ``"task"`` (the task id) and ``"task_type"``.
* ``step(action)``: one assistant message = one turn.
    - If it contains a ``<tool_call>`` (Hermes format), every call in it is run in order and the observation is ONE
      ``"tool"`` message with the results concatenated in order (each prefixed ``[i] name:`` when there are
      several). Every well-formed block (a JSON object naming a tool) counts in ``info["tool_calls"]``; each of
      those that fails (unknown tool, bad arguments, the tool raising, bad return value, timeout) in
      ``info["tool_errors"]``, of which timeouts also in ``info["tool_timeouts"]`` -- so successful calls are
      ``tool_calls - tool_errors``. A block that cannot be parsed as a call at all counts in
      ``info["tool_malformed"]`` (not in ``tool_calls``) and sets ``info["invalid_action"]``.
      ``info["tool_calls_by_name"]`` / ``info["tool_errors_by_name"]`` count well-formed calls and their errors per
      tool (calls to tools the env does not have under :data:`UNKNOWN_TOOL`, so a model inventing names cannot
      grow the metric set). Errors are shown to the policy as the tool result; nothing the policy writes makes
      ``step`` raise; a non-string action is a ``TypeError`` (a bug in the caller, not a policy mistake).
    - Otherwise the message is the final answer: it is graded, the episode terminates, ``reward`` is the grader's
      score, ``info["success"]`` is ``score >= 1`` and ``info["tool_call_before_answer"]`` says whether any tool
      call (successful or not) came earlier in the episode; ``info["expected_answer"]`` is the reference answer
      (given only once the episode is over).
    - The step that ends the episode (answer or turn limit) also has ``info["episode_totals"]``: the episode's
      ``turns``, ``tool_calls``, ``tool_errors``, ``tool_timeouts``, ``tool_malformed``, ``tool_calls_by_name`` and
      ``tool_errors_by_name``.
    - After ``max_turns`` turns without a final answer the episode is truncated (reward 0, ``success`` False,
      ``finish_reason`` ``"max_turns"``): running out of turns is never success.
* The grader is ``grader(response, task) -> float | bool``; the default is
  :func:`agentenv.envs.grading.grade_answer` against ``task.answer`` (``\\boxed{}``, numeric tolerance,
  last-number fallback). Each tool result is cut to ``max_tool_output_chars`` (head and tail kept, marked).
* Subclasses that hold per-episode resources override :meth:`end_episode`, which runs when an episode ends, on
  reset and on close.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence

from agentenv.envs.base import TextEnv
from agentenv.envs.grading import grade_answer
from agentenv.envs.tasks import Task, as_tasks, load_tasks
from agentenv.envs.tools import Tool, ToolResult, execute, has_tool_call, parse_tool_calls

Grader = Callable[[str, Task], "float | bool"]

UNKNOWN_TOOL = "(unknown)"  # per-tool counters' key for calls naming a tool the env does not have

DEFAULT_SYSTEM_PROMPT = (
    "Solve the user's task. You may call the provided tools; each result comes back to you. "
    "When you are done, reply WITHOUT a tool call, giving the final answer as \\boxed{answer}."
)


def default_grader(response: str, task: Task) -> bool:
    return grade_answer(response, task.answer)


def clip(text: str, limit: int) -> str:
    """Keep the head and tail of an over-long tool result: errors and final prints are usually at the end."""
    if len(text) <= limit:
        return text
    head = limit * 2 // 3
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - tail:]}"


class ToolEnv(TextEnv):
    def __init__(
        self,
        tasks: Iterable[Task | Mapping[str, Any]] | str | os.PathLike,
        tools: Sequence[Tool | Callable[..., Any]],
        *,
        grader: Grader | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        max_turns: int = 10,
        max_tool_output_chars: int = 8192,
        render_mode: str | None = None,
    ):
        super().__init__(render_mode=render_mode)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.tasks: list[Task] = load_tasks(tasks) if isinstance(tasks, (str, os.PathLike)) else as_tasks(tasks)
        self.tools: dict[str, Tool] = {}
        for fn in tools:
            t = Tool.from_function(fn)
            if t.name in self.tools:
                raise ValueError(f"two tools are named {t.name!r}")
            self.tools[t.name] = t
        self.grader = grader or default_grader
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.max_tool_output_chars = max_tool_output_chars
        self._task_ids = {t.id: i for i, t in enumerate(self.tasks)}
        self.task: Task | None = None
        self._turns = 0
        self._called_tool = False
        self._done = True
        self._totals = _empty_totals()

    # --- episode hooks ----------------------------------------------------------------------------------------------
    def end_episode(self) -> None:
        """Release per-episode resources (no-op here). Runs at episode end, on reset and on close; idempotent."""

    def close(self) -> None:
        self.end_episode()
        super().close()

    # --- gymnasium API ----------------------------------------------------------------------------------------------
    def tool_schemas(self) -> list[dict]:
        return [t.schema() for t in self.tools.values()]

    def _pick(self, options: dict | None) -> Task:
        options = options or {}
        if "task_id" in options:
            if options["task_id"] not in self._task_ids:
                raise KeyError(f"no task with id {options['task_id']!r}")
            return self.tasks[self._task_ids[options["task_id"]]]
        if "task_index" in options:
            i = int(options["task_index"])
            if not 0 <= i < len(self.tasks):
                raise IndexError(f"task_index {i} out of range: this env has {len(self.tasks)} tasks")
            return self.tasks[i]
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    def format_question(self, task: Task) -> str:
        """The first user message; override to add instructions around the question."""
        return task.question

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.end_episode()
        self.task = self._pick(options)
        self._turns, self._called_tool, self._done = 0, False, False
        self._totals = _empty_totals()
        obs = self.format_question(self.task)
        self._last_text = obs
        info = {"role": "user", "tools": self.tool_schemas(), "task": self.task.id, "task_type": self.task.type}
        if self.system_prompt:
            info["system"] = self.system_prompt
        return obs, info

    def run_tools(self, action: str) -> list[ToolResult]:
        return [execute(call, self.tools) for call in parse_tool_calls(action)]

    def step(self, action: str):
        self.check_action(action)
        if self._done or self.task is None:
            raise RuntimeError("the episode is over (or never started): call reset() before step()")
        self._turns += 1
        if has_tool_call(action):
            results = self.run_tools(action)
            self._called_tool = True
            texts = [clip(r.content, self.max_tool_output_chars) for r in results]
            obs = texts[0] if len(texts) == 1 else "\n\n".join(f"[{i}] {r.name or 'invalid'}:\n{t}" for i, (r, t) in enumerate(zip(results, texts), 1))
            info: dict[str, Any] = {"role": "tool", **self._tool_counts(results)}
            self._add_totals(info)
            truncated = self._turns >= self.max_turns
            if truncated:
                info.update(success=False, finish_reason="max_turns", tool_call_before_answer=False,
                            episode_totals=self._episode_totals())
                self._finish()
            self._last_text = obs
            return obs, 0.0, False, truncated, info
        score = self.grader(action, self.task)
        reward = float(score)
        success = bool(reward >= 1.0)
        info = {"role": "user", "success": success, "tool_call_before_answer": self._called_tool,
                "expected_answer": self.task.answer, "episode_totals": self._episode_totals()}
        obs = f"Final answer received ({'correct' if success else 'incorrect'}; reward {reward:g})."
        self._finish()
        self._last_text = obs
        return obs, reward, True, False, info

    # --- tool counters ----------------------------------------------------------------------------------------------
    def _tool_counts(self, results: list[ToolResult]) -> dict[str, Any]:
        calls = [r for r in results if not r.malformed]
        names = [r.name if r.name in self.tools else UNKNOWN_TOOL for r in calls]
        return {
            "tool_calls": len(calls),
            "tool_errors": sum(r.error for r in calls),
            "tool_timeouts": sum(r.timeout for r in calls),
            "tool_malformed": len(results) - len(calls),
            "invalid_action": len(calls) < len(results),
            "tool_calls_by_name": dict(Counter(names)),
            "tool_errors_by_name": dict(Counter(n for n, r in zip(names, calls) if r.error)),
        }

    def _add_totals(self, info: dict[str, Any]) -> None:
        for k in ("tool_calls", "tool_errors", "tool_timeouts", "tool_malformed"):
            self._totals[k] += info[k]
        for k in ("tool_calls_by_name", "tool_errors_by_name"):
            self._totals[k].update(info[k])

    def _episode_totals(self) -> dict[str, Any]:
        t = self._totals
        return {"turns": self._turns, **{k: t[k] for k in ("tool_calls", "tool_errors", "tool_timeouts", "tool_malformed")},
                "tool_calls_by_name": dict(t["tool_calls_by_name"]), "tool_errors_by_name": dict(t["tool_errors_by_name"])}

    def _finish(self) -> None:
        self._done = True
        self.end_episode()


def _empty_totals() -> dict[str, Any]:
    return {"tool_calls": 0, "tool_errors": 0, "tool_timeouts": 0, "tool_malformed": 0,
            "tool_calls_by_name": Counter(), "tool_errors_by_name": Counter()}
