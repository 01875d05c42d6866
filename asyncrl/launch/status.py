"""`asyncrl status [--json]`: where a run stands, read from Redis (and the run directory).

The JSON object is stable; scripts may rely on it:

    {
      "run_id": "exp1",
      "version": 13,                      # published policy version; null before the first
      "streams": {
        "prompts":      {"length": 12, "lag": 4, "pending": 8},
        "trajectories": {"length": 3, "lag": 1, "pending": 2},
        "dlq":          {"length": 0}
      },
      "counters": {"prompts_released": 40, "groups_published": 22, "groups_trained": 20,
                   "groups_dropped_stale": 2, "groups_dead_lettered": 1, "groups_lost": 0,
                   "entries_rejected": 3},
      "in_flight": 17,
      "balanced": true,
      "workers": {
        "rollout": [{"id": "host-123", "age_s": 0.4, "version": 13}],
        "trainer": [{"id": "trainer-0", "age_s": 0.2, "version": 13}]
      },
      "last_step": {"step": 20, "version": 13, "reward_mean": 0.51, ...},
      "doctor": {"bottleneck": "generation", "headline": "the trainer waited 62% ..."}
    }

- `streams`: `length` is the stream's entry count (acked entries stay until trimmed), `lag` the
  entries not yet delivered to the consumer group (`rollout` for prompts, `trainer` for
  trajectories), `pending` those delivered but not acked (`asyncrl.runstate.stream_stats`). A
  stream that does not exist yet reads as zeros; one without its consumer group has delivered
  nothing, so all its entries are lag.
- `counters`: the run-accounting hash (DESIGN §9); missing fields are 0. `entries_rejected`
  counts dead-lettered entries that ended no released group (junk, duplicates), `groups_lost`
  the groups in flight when Redis lost its data.
- `in_flight`: prompt groups released and not yet ended (HLEN of the `released` hash): queued or
  being generated, or published and not yet acked by the trainer.
- `balanced`: prompts_released == groups_trained + groups_dropped_stale + groups_dead_lettered +
  groups_lost + in_flight. Every change to these is one transaction, so it holds at any moment.
- `workers`: live heartbeats by role, sorted by id; `age_s` is seconds since the worker's last
  heartbeat, `version` the policy version it reported (null if it reported none).
- `last_step`: the trainer's latest step figures: the `last_step` key, else the last step line of
  `{run.dir}/metrics.jsonl`, else null.
- `doctor`: `asyncrl doctor`'s verdict on the latest time breakdowns (the last step's, and each
  live rollout worker's last interval from its heartbeat `time`): `bottleneck` (an
  `asyncrl.reasons.Bottleneck`, null when none passes a threshold) and `headline`; null when
  neither role has reported one. `asyncrl doctor RUN_DIR` gives the whole reading.

When no Redis is reachable (a finished local run, a wrong URL), or the Redis holds no key of the
run (a mistyped `run.id`, a run not started yet, a Redis that lost its data), the object keeps its
keys with `version`, `streams`, `counters`, `in_flight`, `balanced` and `workers` null,
`last_step` comes from the run directory, the reason goes to stderr in one line and the exit
status is 1.

Without `redis.url`, status looks for the local-mode Redis: `asyncrl launch --role all` keeps
its URL in `{run.dir}/redis/url` while it runs. The URL is only ever shown redacted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.metrics.jsonl import read_jsonl
from asyncrl.metrics.record import StepRecord, read_record
from asyncrl.runstate import (
    ROLES,
    Keys,
    live_workers,
    read_accounting,
    read_version,
    run_exists,
    stream_depths,
)

if TYPE_CHECKING:
    import redis

    from asyncrl.config import Config

# status reads only the end of the log: the last step line is within it, whatever the run length.
_LOG_TAIL_BYTES = 1 << 20


def _is_step(value: object) -> bool:
    return isinstance(read_record(value), StepRecord)


def last_step_in_log(run_dir: Path) -> dict[str, Any] | None:
    """The last step line of the log as written (a `StepRecord`'s JSON, figures the line
    lacks left out rather than shown as null)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    steps = [r for r in read_jsonl(path, tail_bytes=_LOG_TAIL_BYTES) if _is_step(r)]
    return steps[-1] if steps else None


def _last_step(client: redis.Redis, keys: Keys, run_dir: Path) -> dict[str, Any] | None:
    raw = client.get(keys.last_step)
    if raw is not None:
        try:
            value = json.loads(raw)
        except ValueError:
            value = None
        if _is_step(value):
            return dict(value)
    return last_step_in_log(run_dir)


def collect_status(client: redis.Redis, keys: Keys, run_dir: Path) -> dict[str, Any]:
    """The status object documented above, from a reachable Redis."""
    version = read_version(client, keys)
    streams = stream_depths(client, keys)
    counters, flying = read_accounting(client, keys)
    return _with_doctor(
        {
            "run_id": keys.run_id,
            "version": version,
            "streams": streams,
            "counters": counters.as_dict(),
            "in_flight": flying,
            "balanced": counters.is_balanced(flying),
            "workers": live_workers(client, keys),
            "last_step": _last_step(client, keys, run_dir),
        }
    )


def _with_doctor(status: dict[str, Any]) -> dict[str, Any]:
    return {**status, "doctor": doctor_summary(status)}


def doctor_summary(status: dict[str, Any]) -> dict[str, Any] | None:
    """The `doctor` entry of the status object (see the module)."""
    from asyncrl.doctor import diagnose, latest_splits

    trainer, rollout = latest_splits(status["last_step"], (status["workers"] or {}).get("rollout"))
    if trainer is None and rollout is None:
        return None
    diagnosis = diagnose(trainer, rollout)
    first = diagnosis.findings[0] if diagnosis.findings else None
    return {
        "bottleneck": diagnosis.bottleneck,
        "headline": "no bottleneck past the thresholds" if first is None else first.headline,
    }


def offline_status(run_id: str, run_dir: Path) -> dict[str, Any]:
    """The status object when Redis cannot be reached: what the run directory holds."""
    return _with_doctor(
        {
            "run_id": run_id,
            "version": None,
            "streams": None,
            "counters": None,
            "in_flight": None,
            "balanced": None,
            "workers": None,
            "last_step": last_step_in_log(run_dir),
        }
    )


def local_redis_url(run_dir: Path) -> str | None:
    """The URL a running `asyncrl launch --role all` left in the run directory, if any."""
    try:
        return (run_dir / "redis" / "url").read_text().strip() or None
    except FileNotFoundError:
        return None


def _has_local_data(run_dir: Path) -> bool:
    """Whether local mode left Redis data (AOF) in the run directory."""
    data = run_dir / "redis"
    return data.is_dir() and any(p.name.startswith("appendonly") for p in data.iterdir())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _age(seconds: float | None) -> str:
    return "age ?" if seconds is None else f"{seconds:.1f}s ago"


def _joined(items: dict[str, Any]) -> str:
    return " · ".join(f"{k} {_fmt(v)}" for k, v in items.items())


def _rows(status: dict[str, Any], redis_line: str) -> list[tuple[str, str]]:
    rows = [("run", status["run_id"]), ("redis", redis_line)]
    streams, counters = status["streams"], status["counters"]
    if streams is not None:
        queues = [f"{name} {_joined(streams[name])}" for name in ("prompts", "trajectories")]
        balance = "balanced" if status["balanced"] else "NOT balanced"
        rows += [
            ("version", _fmt(status["version"])),
            ("queues", " | ".join([*queues, f"dlq length {streams['dlq']['length']}"])),
            ("counters", f"{_joined(counters)} · in_flight {status['in_flight']} ({balance})"),
        ]
        for role in ROLES:
            live = status["workers"][role]
            beats = [f"{w['id']} v{_fmt(w['version'])} {_age(w['age_s'])}" for w in live]
            rows.append((role, " | ".join([f"{len(live)} live", *beats])))
    step = status["last_step"]
    if step is not None:
        rows.append(("last step", _joined(step)))
        if step.get("length_bias_ks") is not None:
            rows.append(("length bias", _length_bias(step)))
    if status["doctor"] is not None:
        rows.append(("doctor", status["doctor"]["headline"]))
    return rows


def _length_bias(step: dict[str, Any]) -> str:
    """The run's length-bias figure and the step's generated → trained episode lengths."""
    sides = [
        f"{name} {_fmt(step.get(f'episode_{name}_generated'))} → "
        f"{_fmt(step.get(f'episode_{name}_trained'))}"
        for name in ("turns", "tokens", "seconds")
    ]
    return " · ".join([f"KS {_fmt(step['length_bias_ks'])}", *sides]) + " (generated → trained)"


def _print(rows: list[tuple[str, str]]) -> None:
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for label, text in rows:
            table.add_row(label, text)
        Console().print(table)
    else:
        for label, text in rows:
            print(f"{label:<10} {text}")


def _from_redis(
    cfg: Config, url: str | None, keys: Keys, run_dir: Path
) -> tuple[dict[str, Any] | None, str, str]:
    """(status, line for the `redis` row, "") or (None, that line, why no status came from
    Redis: it could not be read, or holds no such run)."""
    import redis

    from asyncrl.redis_conn import connect, redact_url

    if url is None:
        return (
            None,
            "not reachable",
            f"redis.url is not set and no local run is running in {run_dir}",
        )
    try:
        client = connect(cfg.redis, url)
        try:
            if not run_exists(client, keys):
                why = (
                    f"no run {keys.run_id!r} in Redis at {redact_url(url)} (no key under "
                    f"{keys.prefix}): is run.id right, and has its trainer started?"
                )
                return None, f"{redact_url(url)} (up, no such run)", why
            return collect_status(client, keys, run_dir), f"{redact_url(url)} (up)", ""
        finally:
            client.close()
    except (redis.RedisError, OSError) as exc:
        return None, "not reachable", f"Redis at {redact_url(url)} is not reachable: {exc}"


def main(cfg: Config, as_json: bool) -> int:
    """Prints the status; 0 when Redis was reached and holds the run, 1 when only the run
    directory was read."""
    run_dir = cfg.run.path
    url = cfg.redis.url or local_redis_url(run_dir)
    if url is None and _has_local_data(run_dir):
        # A finished or interrupted local run: read its AOF with a short-lived redis-server.
        from asyncrl.launch.redis_server import RedisServer

        with RedisServer(data_dir=run_dir / "redis") as server:
            status, redis_line, why = _from_redis(cfg, server.url, Keys(cfg.run.id), run_dir)
    else:
        status, redis_line, why = _from_redis(cfg, url, Keys(cfg.run.id), run_dir)
    if status is None:
        print(f"asyncrl status: {why}; showing what {run_dir} holds", file=sys.stderr)
        status = offline_status(cfg.run.id, run_dir)
    if as_json:
        print(json.dumps(status, indent=2))
    else:
        _print(_rows(status, redis_line))
    return 0 if status["streams"] is not None else 1
