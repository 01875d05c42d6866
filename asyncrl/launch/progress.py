"""Live progress of a local run (`asyncrl launch --role all`).

The launcher calls `update()` about twice a second and `close()` at the end. Step figures come
from `{run.dir}/metrics.jsonl`, read incrementally; queue depths and workers from Redis. Modes:

- `live`: a rich table redrawn in place (the default on a terminal);
- `quiet`: one short line every `quiet_every_s` seconds, and a last one at `close()`, e.g.
  `step 12/200 · v13 · reward 0.51 · eval 0.62 · stale 0.8/2 · lag 4+1 pending 8+2 ·
  1234 tok/s · workers 2r+1t · 0:01:23` (lag and pending: prompts+trajectories);
- `json`: every new line of metrics.jsonl copied to the output as it appears, step and eval lines
  alike (eval lines carry `eval_accuracy`); nothing else is written, so the output is pure JSONL.

A missing log file or a Redis hiccup never raises: the last known figures stay on display.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

from asyncrl.metrics.jsonl import JsonlTail
from asyncrl.metrics.record import EvalRecord, StepRecord, read_record
from asyncrl.runstate import Keys, live_workers, stream_depths

if TYPE_CHECKING:
    import redis
    from rich.live import Live
    from rich.table import Table

Mode = Literal["live", "quiet", "json"]

_REDIS_RETRY_S = 5.0
_NO_STEP = StepRecord(step=0)
"""Shown before the first step line: every figure unknown."""


def _num(value: Any, spec: str = ".3g") -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def _int(value: Any) -> str:
    return str(int(value)) if isinstance(value, int | float) else "-"


def _elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


class Progress:
    def __init__(
        self,
        mode: Mode,
        run_dir: str | Path,
        client: redis.Redis | None,
        keys: Keys,
        max_steps: int | None,
        out: TextIO | None = None,
        quiet_every_s: float = 10.0,
    ) -> None:
        self.mode = mode
        self.client = client
        self.keys = keys
        self.max_steps = max_steps
        self.out = out or sys.stdout
        self.quiet_every_s = quiet_every_s
        self._tail = JsonlTail(Path(run_dir) / "metrics.jsonl")
        self._start = time.monotonic()
        self._last_quiet = -math.inf  # the first update prints at once
        self._redis_retry_at = 0.0
        self._step: StepRecord | None = None
        self._eval: EvalRecord | None = None
        self._streams: dict[str, dict[str, int]] | None = None
        self._workers: dict[str, list[dict[str, Any]]] | None = None
        self._redis_ok = client is not None
        self._live: Live | None = None
        if mode == "live":
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._table(), console=Console(file=self.out), auto_refresh=False)
            self._live.start()

    def update(self) -> None:
        for record in self._tail.read_new():
            if self.mode == "json":
                self.out.write(json.dumps(record) + "\n")
            typed = read_record(record)
            if isinstance(typed, EvalRecord):
                self._eval = typed
            elif typed is not None:
                self._step = typed
        if self.mode == "json":
            self.out.flush()
            return
        self._poll_redis()
        if self._live is not None:
            self._live.update(self._table(), refresh=True)
        elif time.monotonic() - self._last_quiet >= self.quiet_every_s:
            self._print_line()

    def close(self) -> None:
        self.update()
        if self._live is not None:
            self._live.stop()
        elif self.mode == "quiet":
            self._print_line()

    def _poll_redis(self) -> None:
        import redis

        if self.client is None or time.monotonic() < self._redis_retry_at:
            return
        try:
            self._streams = stream_depths(self.client, self.keys)
            self._workers = live_workers(self.client, self.keys)
            self._redis_ok = True
        except (redis.RedisError, OSError):
            # Keep the last figures, and do not retry on every update: against a hung server
            # each try can block for the socket timeout and freeze the display.
            self._redis_ok = False
            self._redis_retry_at = time.monotonic() + _REDIS_RETRY_S

    def _fields(self) -> list[tuple[str, str]]:
        step, ev = self._step or _NO_STEP, self._eval
        limit = f"/{self.max_steps}" if self.max_steps else ""
        fields = [
            ("step", f"{_int(self._step and step.step)}{limit}"),
            ("version", _int(step.version)),
            ("reward", _num(step.reward_mean)),
            ("eval", f"{_num(ev and ev.eval_accuracy)} @ step {_int(ev and ev.step)}"),
            ("staleness", f"{_num(step.staleness_mean)} mean, {_num(step.staleness_max)} max"),
            ("length bias", f"KS {_num(step.length_bias_ks)}"),
        ]
        if self._streams is not None:
            for name in ("prompts", "trajectories"):
                s = self._streams[name]
                fields.append((name, f"lag {s['lag']}, pending {s['pending']}"))
            fields.append(("dlq", str(self._streams["dlq"]["length"])))
        fields.append(("tokens/s", _num(step.throughput, ".4g")))
        fields.append(("weight sync", f"{_num(step.weight_publish_blocking_seconds)} s blocking"))
        if self._workers is not None:
            fields.append(
                ("workers", ", ".join(f"{len(w)} {role}" for role, w in self._workers.items()))
            )
        if not self._redis_ok:
            fields.append(("redis", "unreachable"))
        fields.append(("elapsed", _elapsed(time.monotonic() - self._start)))
        return fields

    def _table(self) -> Table:
        from rich.table import Table

        table = Table(title=f"asyncrl {self.keys.run_id}", show_header=False, title_justify="left")
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for label, text in self._fields():
            table.add_row(label, text)
        return table

    def _print_line(self) -> None:
        self._last_quiet = time.monotonic()
        step, ev = self._step or _NO_STEP, self._eval
        limit = f"/{self.max_steps}" if self.max_steps else ""
        parts = [
            f"step {_int(self._step and step.step)}{limit}",
            f"v{_int(step.version)}",
            f"reward {_num(step.reward_mean)}",
            f"eval {_num(ev and ev.eval_accuracy)}",
            f"stale {_num(step.staleness_mean)}/{_int(step.staleness_max)}",
        ]
        if self._streams is not None:
            p, t = self._streams["prompts"], self._streams["trajectories"]
            parts.append(f"lag {p['lag']}+{t['lag']} pending {p['pending']}+{t['pending']}")
        parts.append(f"{_num(step.throughput, '.4g')} tok/s")
        if self._workers is not None:
            parts.append(
                f"workers {len(self._workers['rollout'])}r+{len(self._workers['trainer'])}t"
            )
        if not self._redis_ok:
            parts.append("redis unreachable")
        parts.append(_elapsed(time.monotonic() - self._start))
        self.out.write(" · ".join(parts) + "\n")
        self.out.flush()
