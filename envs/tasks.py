"""Question/answer tasks for tool environments, and loading them from JSONL or Parquet files.

Contract:

* :class:`Task` is ``(question, answer, id, type, meta)``. ``answer`` is always stored as text (numbers are
  converted with ``str``) because graders compare text. ``id`` defaults to a hash of the question, so the same
  question has the same id in every run and every file; ``type`` is the category metrics are broken down by.
* :func:`load_tasks(path)` reads ``.jsonl`` / ``.json`` (one JSON object per line) or ``.parquet`` files with
  ``question`` and ``answer`` columns (other names via ``question_key`` / ``answer_key``); optional ``id`` and
  ``type`` columns are used, any other columns go to ``meta``. Parquet needs ``pyarrow`` (or pandas with a Parquet
  engine); without one the error says what to install. A missing column, an empty file or a bad line is an error
  naming the file and line -- a task set is never silently shortened.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class Task:
    question: str
    answer: str
    id: str = ""
    type: str | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError(f"task question must be a non-empty string, got {self.question!r}")
        if self.answer is None:
            raise ValueError(f"task {self.question[:60]!r} has no answer")
        object.__setattr__(self, "answer", str(self.answer))
        if not self.id:
            object.__setattr__(self, "id", "q-" + hashlib.sha1(self.question.encode()).hexdigest()[:12])

    @classmethod
    def from_mapping(cls, row: Mapping[str, Any], *, question_key: str = "question", answer_key: str = "answer") -> "Task":
        missing = [k for k in (question_key, answer_key) if k not in row]
        if missing:
            raise ValueError(f"missing {missing} (has {sorted(row)})")
        meta = {k: v for k, v in row.items() if k not in (question_key, answer_key, "id", "type")}
        tid, ttype = row.get("id"), row.get("type")
        return cls(row[question_key], row[answer_key], str(tid) if tid is not None else "",
                   str(ttype) if ttype is not None else None, meta)


def as_tasks(tasks: Iterable[Task | Mapping[str, Any]]) -> list[Task]:
    out = [t if isinstance(t, Task) else Task.from_mapping(t) for t in tasks]
    if not out:
        raise ValueError("a tool environment needs at least one task")
    return out


def _parquet_rows(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        try:
            import pandas as pd

            return pd.read_parquet(path).to_dict(orient="records")
        except ImportError:
            raise ImportError(
                f"reading {path} needs pyarrow (pip install pyarrow) or pandas with a Parquet engine; "
                "or convert the file to JSONL (one {\"question\": ..., \"answer\": ...} object per line)"
            ) from None
    return pq.read_table(path).to_pylist()


def load_tasks(path: str | os.PathLike, *, question_key: str = "question", answer_key: str = "answer") -> list[Task]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"task file {path} does not exist")
    suffix = "".join(path.suffixes[-1:]).lower()
    if suffix == ".parquet":
        rows = [(i + 1, r) for i, r in enumerate(_parquet_rows(path))]
    elif suffix in (".jsonl", ".json", ".ndjson"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
                rows.append((lineno, row))
    else:
        raise ValueError(f"{path}: unsupported task file type {suffix!r}; use .jsonl or .parquet")
    tasks = []
    for where, row in rows:
        try:
            tasks.append(Task.from_mapping(row, question_key=question_key, answer_key=answer_key))
        except ValueError as e:
            raise ValueError(f"{path}:{where}: {e}") from None
    if not tasks:
        raise ValueError(f"{path}: no tasks in file")
    return tasks
