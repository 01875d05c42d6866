"""What every role process holds, built once for the trainer's and the rollout worker's builders.

`open_runtime` connects to Redis, makes the role's metrics and serves them (before anything
slow: a port another process holds ends the role at once), and makes the guard that waits out
Redis outages for the role's own calls until it is told to stop. The runtime then builds what
both roles build alike — consumers of their input stream, the heartbeat, the readers' `Limits`,
the model directory, tokenizer and task — and holds the staleness bound both enforce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.runstate import Keys

if TYPE_CHECKING:
    from pathlib import Path

    import redis
    from transformers import PreTrainedTokenizerBase

    from asyncrl.config import Config
    from asyncrl.heartbeat import Heartbeat
    from asyncrl.lease import Lease
    from asyncrl.metrics.roles import RoleMetrics
    from asyncrl.protocol import Limits
    from asyncrl.queue import Consumer, Groups
    from asyncrl.redis_conn import RedisGuard
    from asyncrl.tasks.base import Task

T = TypeVar("T")
Health = Callable[[], tuple[bool, str]]


def staleness_bound(cfg: Config) -> int:
    """η: how many versions a trained token may lag the trained weights (0 in sync mode)."""
    return 0 if cfg.run.mode == "sync" else cfg.algo.max_staleness


def _ready() -> tuple[bool, str]:
    return True, "ok"


@dataclass
class StopFlag:
    """What SIGTERM tells a role. Its Redis waits poll it (as `should_stop`)."""

    stopping: bool = False
    """The first SIGTERM (or a lost lease): Redis waits end, the role leaves at its next check."""
    abandoning: bool = False
    """A second SIGTERM: a role that drains its work leaves without finishing it."""

    def on_sigterm(self, *_: object) -> None:
        self.abandoning = self.stopping
        self.stopping = True

    def __call__(self) -> bool:
        return self.stopping


@dataclass
class RoleRuntime:
    """One role process's connection to the run (see the module's docstring)."""

    cfg: Config
    role: str
    name: str
    """The worker id: the role's heartbeat, metrics label and consumer name."""
    keys: Keys
    client: redis.Redis
    metrics: RoleMetrics
    stop: StopFlag
    max_staleness: int
    ready: Health = _ready
    """What `/healthz` asks once Redis answers; a role replaces it as it comes up."""

    def health(self) -> tuple[bool, str]:
        try:
            self.client.ping()
        except Exception as exc:  # any failure to reach Redis means not ready
            return False, f"redis: {type(exc).__name__}"
        return self.ready()

    @cached_property
    def redis(self) -> RedisGuard:
        """The role's one guard: its own Redis calls and its queue clients wait out outages up to
        `redis.reconnect_max_s` between tries, until SIGTERM, marked on its metrics."""
        from asyncrl.redis_conn import RedisGuard

        return RedisGuard(
            reconnect_max_s=self.cfg.redis.reconnect_max_s,
            should_stop=self.stop,
            on_outage=self.metrics.redis_outage,
        )

    def consumer(
        self,
        stream: str,
        group: str,
        groups: Groups[T],
        *,
        decode: Callable[[bytes], T] | None = None,
        decode_batch: Callable[[list[bytes]], Sequence[T | Exception]] | None = None,
    ) -> Consumer[T]:
        """This role's member of `group` on `stream`: entries of dead peers of the same role are
        taken over; `decode` gets an entry's data field, or `decode_batch` those of a read's
        entries at once (an entry without one is malformed)."""
        from asyncrl.heartbeat import is_alive
        from asyncrl.queue import Consumer

        return Consumer(
            self.client,
            stream,
            group,
            self.name,
            self.cfg.queue,
            dlq=self.keys.dlq,
            counters_key=self.keys.counters,
            is_alive=is_alive(self.client, self.keys, self.role),
            decode=None if decode is None else _entry_data(decode),
            decode_batch=None if decode_batch is None else _entries_data(decode_batch),
            groups=groups,
            guard=self.redis,
        )

    def heartbeat(
        self, status: Callable[[], dict[str, Any]], lease: Lease | None = None
    ) -> Heartbeat:
        from asyncrl.heartbeat import Heartbeat

        key = self.keys.worker(self.role, self.name)
        return Heartbeat(self.client, key, self.cfg.rollout.heartbeat_ttl_s, status, lease=lease)

    def model_dir(self, *, wait_s: float = 0.0) -> Path:
        from asyncrl.model import ensure_model

        return ensure_model(self.cfg, wait_s=wait_s)

    def tokenizer(self, model_dir: Path) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)

    def task(self, tokenizer: PreTrainedTokenizerBase) -> Task:
        from asyncrl.tasks.build import build_task

        return build_task(self.cfg.task, tokenizer)

    def limits(self, model_dir: Path) -> Limits:
        """What readers of this run's entries check: its message bound, the model's vocabulary."""
        from asyncrl.model import vocab_size
        from asyncrl.protocol import Limits

        return Limits(
            max_message_bytes=self.cfg.queue.max_message_bytes, vocab_size=vocab_size(model_dir)
        )


def _entry_data(decode: Callable[[bytes], T]) -> Callable[[dict[bytes, bytes]], T]:
    def decode_entry(fields: dict[bytes, bytes]) -> T:
        from asyncrl.protocol import ValidationError

        data = fields.get(b"data")
        if data is None:
            raise ValidationError("malformed", "entry has no data field")
        return decode(data)

    return decode_entry


def _entries_data(
    decode: Callable[[list[bytes]], Sequence[T | Exception]],
) -> Callable[[list[dict[bytes, bytes]]], list[T | Exception]]:
    def decode_entries(batch: list[dict[bytes, bytes]]) -> list[T | Exception]:
        from asyncrl.protocol import ValidationError

        datas = [fields.get(b"data") for fields in batch]
        decoded = iter(decode([data for data in datas if data is not None]))
        missing = ValidationError("malformed", "entry has no data field")
        return [missing if data is None else next(decoded) for data in datas]

    return decode_entries


def open_runtime(
    cfg: Config, role: str, name: str, *, serves_metrics: bool = True, ready: Health = _ready
) -> RoleRuntime:
    """Connect, make the role's metrics and serve them on `metrics.port` (when set and
    `serves_metrics`): before the model loads, so a port another process holds ends the role at
    once. `ready`: what `/healthz` reports once Redis answers, until the role replaces it."""
    from asyncrl.metrics.roles import RoleMetrics
    from asyncrl.metrics.server import serve
    from asyncrl.redis_conn import connect

    client = connect(cfg.redis)
    metrics = RoleMetrics(role, name)
    runtime = RoleRuntime(
        cfg, role, name, Keys(cfg.run.id), client, metrics, StopFlag(), staleness_bound(cfg), ready
    )
    if serves_metrics and cfg.metrics.port:
        serve(cfg.metrics.host, cfg.metrics.port, runtime.health)
    return runtime
