"""The run's JSONL metrics log, `{run.dir}/metrics.jsonl`, written by trainer rank 0.

One object per line, all with `step` and `wall_seconds`: step lines (`record.StepRecord`, one
per optimizer step) and eval lines (`record.EvalRecord`, which carry `eval_accuracy`; see
`record.is_eval_record`). Readers skip lines cut short by a crash.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _plain(value: Any) -> Any:
    """JSON-ready data: NaN/inf become null (standard JSON has no such numbers, and jq or
    pandas would reject the line), numpy/torch scalars become Python numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return _plain(value.item())
    raise TypeError(f"metrics.jsonl: cannot write a {type(value).__name__}")


class JsonlWriter:
    """Appends one JSON object per line to `path`, flushed per line so readers (progress,
    `asyncrl status`) see each step as soon as it is written."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        if self._file.tell() > 0 and not _ends_with_newline(self.path):
            # A crash mid-write left a partial line: end it, so the first record of the
            # resumed run does not merge into it.
            self._file.write("\n")

    def write(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(_plain(record), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ends_with_newline(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _parse_lines(lines: list[bytes]) -> list[dict[str, Any]]:
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash: the last one, or one a resumed writer ended
        if isinstance(record, dict):
            records.append(record)
    return records


def read_jsonl(path: str | Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The records of a JSONL log, skipping lines cut short by a crash. With `tail_bytes`, only
    the records that lie wholly in the last `tail_bytes` bytes (a cheap look at the latest)."""
    with Path(path).open("rb") as f:
        size = f.seek(0, 2)
        start = 0 if tail_bytes is None else max(0, size - tail_bytes)
        f.seek(start)
        lines = f.read().splitlines()
    if start > 0:
        lines = lines[1:]
    return _parse_lines(lines)


class JsonlTail:
    """Reads the records appended to a JSONL log since the last call (file offset kept).

    Only whole lines are consumed: a line still being written is read on a later call. A missing
    file reads as empty; a file that shrank (a fresh run in the same directory) is re-read.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                if f.seek(0, 2) < self.offset:
                    self.offset = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return _parse_lines(data[:end].splitlines())
