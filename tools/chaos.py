"""Chaos soak: SIGKILL and restart rollout workers, the trainer and Redis at random, then check
that nothing was lost or trained twice (DESIGN §9; figures in docs/reliability.md).

    python tools/chaos.py --seconds 120 --workers 3 [--trainer-ranks 1] --seed 0
    python tools/chaos.py --seconds 120 --workers 1   # a lone worker: the shape that deadlocked
    python tools/chaos.py --faults 120 --task agentic  # multi-turn episodes behind a tool
    python tools/chaos.py --faults 60 --task agentic --stale-policy drop  # the drop policy

It runs a local cluster of real processes — its own redis-server (AOF with `appendfsync always`),
one trainer (under torchrun for several ranks) and `--workers` rollout workers on an untrained
tiny model — with settings that make every recovery path fast: heartbeat TTL 2 s, `claim_idle_s`
1 s, a checkpoint every 2 steps, reconnect backoff capped at 1 s. `--task agentic` runs 3-turn
episodes behind a tool (`TASKS`) instead of single-turn ones: episodes span several versions and
workers are killed mid-episode; under `--stale-policy train` (the default, as in a run) episodes
go on with new weights and are trained, under `drop` workers give groups up mid-episode as sure
to be stale. It injects one fault at a time, dealt
from shuffled decks (`--deck`, default `DECK`), so kinds always mix:

- `worker`: SIGKILL a rollout worker that is generating; restart it at once, half the time under
  its id (it re-reads its own pending prompts), half under a new one (the dead id's prompts are
  taken over once its heartbeat expires);
- `trainer`: SIGKILL the trainer; restart it at once (it resumes from its last checkpoint);
- `redis`: SIGKILL redis-server; restart it on the same port and data directory 0.2-3 s later;
- `redis_empty`: SIGKILL redis-server and restart it on the same port with no data at all (a
  Redis without persistence, or a lost volume). What it held is read back first, from its data
  directory by a second server, as one segment of the run's history (below);
- `redis_full`: lower Redis's `maxmemory` to just above what it uses, fill it with 1 MB junk
  entries on the trajectories stream (plain redis-py), hold it full 2-4 s, then lift the limit;
- `hostile`: add entries an outsider could write, built with plain msgpack: groups of prompts
  never released, a real trajectory entry added again, a group with no samples, out-of-vocabulary
  and negative token ids, undecodable bytes, and prompts that admission never released;
- `freeze`: SIGSTOP a rollout worker that holds prompts past its heartbeat, until the others
  have taken every one of them over (`takeover`: a violation if they do not), then SIGCONT it.
  It wakes between turns of episodes no longer its own: every late result of it (a group, a
  dead letter, a stale drop) must be refused; the summary's `late_results_refused` counts the
  refused acks.

After each fault it waits for progress — the trainer finishing a step and writing it to Redis —
before the next one; none within `--progress-timeout-s` ends the run as a violation. It stops
after `--seconds` of faults (or `--faults` faults), drains — rollout workers get SIGTERM and
publish the batch in hand, then the trainer, which checkpoints and acks what it trained — and
checks, with every role stopped:

- `roles_survive`: no role exited unless killed (roles ride out Redis restarts); such a role is
  restarted, and its exit reported with the asyncrl frames of its traceback;
- `balanced`: released = trained + dropped stale + dead-lettered + lost + in flight;
- `nothing_lost`: every prompt entry became exactly one trajectory entry, a dead letter, a group
  its worker gave up as sure to be stale (acked with neither, counted `groups_dropped_stale`),
  or is still queued — or was queued when Redis lost its data (`redis_empty`); checked by count
  where entries leave no trace (`account`). Without such a loss `groups_published` equals the
  trajectory entries. Streams are not trimmed in this run, so the whole history can be read back
  (trimming has its tests in tests/test_queue.py), segment by segment where Redis restarted
  empty. The summary's `ended` splits the released groups by every way a group ends — trained,
  dropped stale by the trainer, given up stale by a worker, dead-lettered, lost with Redis's
  data, or still in flight (prompts not started when the workers drained) — and `ended` must
  sum to the groups released;
- `hostile`: every entry the tool added as an outsider is dead-lettered with a reason its kind
  allows (or was still queued when Redis lost its data), never trained, and counted
  `entries_rejected`, not as a dead-lettered group;
- `versions`: the step lines' versions increase strictly across every restart — a number is
  never reused, even by a trainer that resumes against a Redis that lost its data;
- `no_double_training`: no prompt has two trajectory entries, and `groups_trained` equals the
  final checkpoint's step × groups per step — each step of the surviving lineage acks its
  groups once, so a group acked twice, an ack leaked from a lineage that did not survive, or a
  group trained again after its checkpoint was durable all break the equality. The summary's
  `killed_before_ack` lists the checkpoints the trainer was killed after but before acking
  their groups: the window in which the last of these can happen;
- `staleness`: under `drop`, no step line shows `staleness_max` above η; under `train`, no group
  was dropped stale at all (by the trainer or a worker) — staler groups are trained;
- `admission`: at every poll, released − trained − dropped − dead-lettered (one atomic read of
  the counters) ≤ (η + 1 + checkpoint_every) × G: η + 1 steps of admission, plus the steps
  trained but not yet acked;
- `dead_letters`: the only dead-letter reason of a real entry is `max_deliveries` (a prompt whose
  workers kept dying); any other means a role wrote an invalid entry;
- `progress`, `drain`: see above; a drain that times out or a trainer that does not exit 0.

`appendfsync always` matters: a SIGKILLed Redis with the default `everysec` may lose the last
second of writes — say a worker's publish-and-ack after the worker saw it succeed — and then the
accounting cannot balance, by design, not by bug.

Prints a summary, then the summary as one JSON line, and exits 1 on any violation.
`run_chaos(...)` does the same and returns the summary (tests/test_chaos.py). Every process is
started here, in its own session, and killed by its handle only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

import msgpack
import numpy as np
import redis

from asyncrl.config import write_config
from asyncrl.launch.local import start_logged
from asyncrl.launch.redis_server import RedisServer
from asyncrl.metrics.jsonl import JsonlTail
from asyncrl.metrics.record import is_eval_record
from asyncrl.protocol import decode_group
from asyncrl.runstate import (
    PROMPTS_GROUP,
    TRAJECTORIES_GROUP,
    Counters,
    Keys,
    read_accounting,
    read_counters,
    stream_depths,
)
from asyncrl.runstate import Counter as RunCounter
from asyncrl.trainer.checkpoint import list_checkpoints

RUN_ID = "chaos"
G = 2  # prompt groups per step and trainer rank
N = 2  # samples per group
MAX_STALENESS = 2
CHECKPOINT_EVERY = 2
DECK = {
    "worker": 4,
    "trainer": 2,
    "redis": 2,
    "redis_empty": 1,
    "redis_full": 1,
    "hostile": 1,
    "freeze": 2,
}
HEARTBEAT_TTL_S = 2.0
CLAIM_IDLE_S = 1.0
TASKS: dict[str, dict[str, Any]] = {
    "arithmetic": {"task.type": "arithmetic"},
    # Three turns behind a short tool: an episode spans several trainer versions (under the drop
    # policy workers give groups up as sure to be stale mid-episode, `Consumer.drop`), and a
    # frozen worker holds episodes between turns.
    "agentic": {
        "task.type": "agentic",
        "task.turns": 3,
        "task.eval_size": 20,
        # configs/agentic.yaml's tool: the slowest of a hundred calls takes ~16× the median.
        "task.tool_latency_median_s": 0.1,
        "task.tool_latency_sigma": 1.2,
    },
}
"""`--task`: the run's task settings. `arithmetic` is single-turn."""
POLL_S = 0.2
_FRAME = re.compile(r'File "[^"]*/(asyncrl/[^"]+)", line \d+, in (\w+)')
# Dead-letter reasons an undecodable entry may get (what msgpack or the schema check trips on).
_UNDECODABLE = frozenset({"malformed", "schema", "too_large"})
# Entries naming a prompt nobody released may be refused for that before their tokens are read.
_BAD_TOKENS = frozenset({"token_out_of_range", "unreleased"})
JUNK_BYTES = 1 << 20  # one `redis_full` junk entry
# What a worker logs when the ack of its results finds their prompts taken over (`Consumer.ack`).
_REFUSED = "not applied: taken over by another consumer"


def settings(
    run_dir: Path,
    url: str,
    model: Path,
    groups_per_step: int,
    weights: str,
    task: str,
    stale_policy: str = "train",
) -> dict[str, Any]:
    """The run's config as dotted keys."""
    return {
        **TASKS[task],
        "algo.stale_policy": stale_policy,
        "run.id": RUN_ID,
        "run.dir": str(run_dir),
        "redis.url": url,
        "redis.reconnect_max_s": 1.0,
        "model.path": str(model),
        "metrics.port": 0,
        "rollout.n": N,
        "rollout.prompts_per_batch": 1,
        "rollout.heartbeat_ttl_s": HEARTBEAT_TTL_S,
        "rollout.sampling.max_new_tokens": 4,
        "queue.claim_idle_s": CLAIM_IDLE_S,
        "queue.claim_every_s": 0.5,
        "queue.trim_every_s": 1e9,  # keep the history for the checks (module docstring)
        "queue.dead_letter_max_entries": 10**6,  # and every dead letter
        "trainer.device": "cpu",
        "trainer.groups_per_step": groups_per_step,
        "trainer.max_steps": 10**9,
        "trainer.checkpoint_every": CHECKPOINT_EVERY,
        "trainer.keep_checkpoints": 2,
        "trainer.eval_every": 0,
        "trainer.wait_timeout_s": 3600,
        "algo.max_staleness": MAX_STALENESS,
        # Untrained, the model's groups mostly have equal rewards: keep them in the steps.
        "algo.filter_zero_variance": False,
        "weights.type": weights,
        # A subscriber killed after it said ready holds up a broadcast group's forming for
        # sync_timeout_s (by design), and every group generated meanwhile is stale: keep it short.
        "weights.sync_timeout_s": 5.0,
        "weights.lease_s": 2.0,
    }


def _i32(values: list[int]) -> bytes:
    return np.asarray(values, "<i4").tobytes()


def _wire_group(group_id: str, prompt_ids: list[int], samples: list[list[int]]) -> dict[str, Any]:
    """Stream fields of a trajectory group, packed by hand as an outsider would (the wire
    format of asyncrl/protocol/, not its encoder)."""
    data = {
        "schema": 1,
        "run": RUN_ID,
        "group_id": group_id,
        "prompt_id": f"hostile-{group_id}",
        "release_version": 0,
        "worker": "outsider",
        "created_at": time.time(),
        "finished_at": time.time(),
        "prompt_ids": _i32(prompt_ids),
        "samples": [
            {
                "response_ids": _i32(ids),
                "logprobs": np.full(len(ids), -0.5, "<f4").tobytes(),
                "versions": _i32([0] * len(ids)),
                "reward": 1.0,
                "finish": "stop",
            }
            for ids in samples
        ],
    }
    return {"data": msgpack.packb(data), "schema": b"1", "min_version": b"0"}


def _wire_prompt(prompt_ids: list[int]) -> dict[str, Any]:
    data = {
        "schema": 1,
        "run": RUN_ID,
        "prompt_id": "hostile",
        "prompt": "",
        "prompt_ids": _i32(prompt_ids),
        "answer": "",
        "task": "arithmetic",
        "n": N,
        "release_version": 0,
    }
    return {"data": msgpack.packb(data), "schema": b"1"}


def hostile_entries(
    vocab: int, acked: tuple[bytes, dict[bytes, bytes]] | None
) -> list[tuple[str, str, dict[Any, Any], frozenset[str]]]:
    """(kind, stream suffix, fields, dead-letter reasons allowed) of one `hostile` fault.
    `acked`: a real trajectory entry the trainer is done with, to add again."""
    never = "1-1"  # an entry id no admission ever made (ids start from the clock)
    entries: list[tuple[str, str, dict[Any, Any], frozenset[str]]] = [
        (
            "unreleased",
            "trajectories",
            _wire_group(never, [1, 2], [[3], [4]]),
            frozenset({"unreleased"}),
        ),
        (
            "no_samples",
            "trajectories",
            _wire_group(never, [1, 2], []),
            frozenset({"malformed", "unreleased"}),
        ),
        (
            "response_out_of_vocab",
            "trajectories",
            _wire_group(never, [1, 2], [[vocab], [3]]),
            _BAD_TOKENS,
        ),
        (
            "prompt_negative_id",
            "trajectories",
            _wire_group(never, [-1, 2], [[3], [4]]),
            _BAD_TOKENS,
        ),
        ("undecodable", "trajectories", {"data": b"\xc1junk", "schema": b"1"}, _UNDECODABLE),
        ("prompt_unreleased", "prompts", _wire_prompt([1, 2]), frozenset({"unreleased"})),
        (
            "prompt_out_of_vocab",
            "prompts",
            _wire_prompt([1, vocab + 7]),
            _BAD_TOKENS,
        ),
    ]
    if acked is not None:
        entries.append(
            ("duplicate", "trajectories", dict(acked[1]), frozenset({"duplicate", "unreleased"}))
        )
    return entries


def _descendants(pid: int) -> list[int]:
    """Pids of the processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(text[text.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class Child:
    """One role process, the leader of its own session. `kill()` SIGKILLs that session and every
    process below it — a torchrun agent starts each rank in a session of its own — nothing else.
    """

    def __init__(self, name: str, argv: list[str], log: Path) -> None:
        self.name, self.argv, self.log = name, argv, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.expected_exit = False
        self._log_from = 0

    def start(self, argv: list[str] | None = None) -> None:
        self.argv = argv or self.argv
        self.expected_exit = False
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = start_logged(self.argv, self.log, env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        """What this process (since its last start) has logged."""
        with self.log.open("rb") as f:
            f.seek(self._log_from)
            return f.read().decode(errors="replace")

    def ready(self) -> bool:
        """Alive, and this process has logged that it is generating."""
        return self.alive() and " ready at version " in self.output()

    def kill(self) -> None:
        if self.proc is None:
            return
        self.expected_exit = True
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def freeze(self) -> None:
        """SIGSTOP the process and every process below it: alive, holding what it read, silent
        (its heartbeat lapses)."""
        self._signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: signal.Signals) -> None:
        """`sig` to this process's session and every process below it, if it still runs."""
        if self.proc is None or self.proc.poll() is not None:
            return
        below = _descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):  # exited meanwhile
            os.killpg(self.proc.pid, sig)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait; the exit code, or None if it had to be killed."""
        if self.proc is None:
            return None
        self.expected_exit = True
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None


@dataclass
class Fault:
    kind: str
    target: str
    at_s: float
    recovered_after_s: float | None = None
    """Seconds from the fault to the next step that reached Redis."""
    unacked_checkpoint: int | None = None
    """Trainer faults: the step of a checkpoint that was durable when the trainer died but whose
    groups were not acked yet. The restarted trainer resumes from it and re-reads those groups
    as pending, so unless it acks them first, it trains them a second time."""
    held: int | None = None
    """`freeze` faults: the prompts the frozen worker had read and not acked when it stopped."""
    taken_over: int | None = None
    """`freeze` faults: how many of those had left it (taken over by another worker, or ended)
    when it was resumed; its late results for them must be refused."""


@dataclass
class Segment:
    """What one Redis lifetime held at its end: the whole run when Redis never lost its data,
    else the stretch up to one `redis_empty` fault, or from the last one to the end."""

    counters: Counters
    streams: dict[str, dict[str, int]]
    in_flight: int
    prompts: list[str]
    """Prompt entry ids, in order."""
    trajectories: dict[str, str | None]
    """Trajectory entry id → the prompt entry id its group answers (None: undecodable)."""
    dlq: list[tuple[str, str, str]]
    """(origin stream, entry id, reason) of each dead letter."""
    queued: set[tuple[str, str]]
    """(stream, entry id) of the entries their group has not acked (pending or never delivered);
    ids are per stream: two streams may hand out the same one."""


def read_segment(client: redis.Redis, keys: Keys) -> Segment:
    def entries(stream: str) -> list[tuple[str, dict[bytes, bytes]]]:
        rows = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(stream))
        return [(i.decode(), f) for i, f in rows]

    def group_id(fields: dict[bytes, bytes]) -> str | None:
        try:
            return decode_group(fields[b"data"]).group_id
        except (KeyError, ValueError):
            return None

    counters, in_flight = read_accounting(client, keys)
    return Segment(
        counters=counters,
        streams=stream_depths(client, keys),
        in_flight=in_flight,
        prompts=[i for i, _ in entries(keys.prompts)],
        trajectories={i: group_id(f) for i, f in entries(keys.trajectories)},
        dlq=[
            (f[b"stream"].decode(), f[b"id"].decode(), f[b"reason"].decode())
            for _, f in entries(keys.dlq)
        ],
        queued={(keys.prompts, i) for i in _queued(client, keys.prompts, PROMPTS_GROUP)}
        | {(keys.trajectories, i) for i in _queued(client, keys.trajectories, TRAJECTORIES_GROUP)},
    )


def _queued(client: redis.Redis, stream: str, group: str) -> set[str]:
    """Entry ids `group` has not acked: pending, or after its last-delivered id (lag)."""
    try:
        groups = cast(list[dict[str, Any]], client.xinfo_groups(stream))
    except redis.ResponseError:  # no such stream
        return set()
    info = next((g for g in groups if g["name"].decode() == group), None)
    if info is None:  # the group was never created: nothing was delivered
        rows = cast(list[tuple[bytes, Any]], client.xrange(stream))
        return {i.decode() for i, _ in rows}
    last = info["last-delivered-id"].decode()
    pending = cast(list[dict[str, Any]], client.xpending_range(stream, group, "-", "+", 10**6))
    rows = cast(list[tuple[bytes, Any]], client.xrange(stream, min=f"({last}"))
    return {p["message_id"].decode() for p in pending} | {i.decode() for i, _ in rows}


@dataclass
class Ledger:
    """How the released groups of a run's history ended, from its streams (`account`)."""

    published: Counter[str] = field(default_factory=Counter)
    """Prompt entry id → its trajectory entries (more than one: trained twice)."""
    reasons: Counter[str] = field(default_factory=Counter)
    """Dead letters by reason, injected entries' included."""
    rejected: dict[tuple[str, str], str] = field(default_factory=dict)
    """(stream, entry id) of each injected entry dead-lettered → the reason."""
    untraced: int = 0
    """Real prompt entries acked with no trajectory entry and no dead letter: groups a worker
    gave up as sure to be stale (`Consumer.drop`), or dead-lettered where a full Redis refused
    the record."""
    unrecorded_dead_letters: int = 0
    """Of those, dead letters the counters hold and the dead-letter stream does not (first
    segment, where the counters began at 0)."""
    lost: int = 0
    """Prompt entries that ended with no outcome counted."""
    violations: list[tuple[str, str]] = field(default_factory=list)
    """(check, message)."""

    def ended(self, final: Counters, in_flight: int = 0) -> dict[str, Any]:
        """Every way a released group ended, by the final counters: trained, dropped stale by
        the trainer or by a worker (after a loss of Redis's data, with any dead letter a full
        Redis refused to record), dead-lettered, lost with Redis's data — or not yet: still in
        flight (`in_flight`, the `released` hash). The values sum to the groups released."""
        by_workers = self.untraced - self.unrecorded_dead_letters
        return {
            "trained": final.groups_trained,
            "dropped_stale_by_trainer": final.groups_dropped_stale - by_workers,
            "dropped_stale_by_workers": by_workers,
            "dead_lettered": final.groups_dead_lettered,
            "lost_with_redis": final.groups_lost,
            "in_flight": in_flight,
        }


def account(
    segments: list[Segment], injected: Mapping[tuple[str, str], object], keys: Keys
) -> Ledger:
    """Read every segment's streams back and check that each real prompt entry ended exactly one
    way: one trajectory entry, a dead letter, given up by its worker as sure to be stale, or it
    is still queued (or was, when Redis lost its data). A worker's stale drop acks the prompt and
    leaves no entry, only the count `groups_dropped_stale`, so it is checked by count: in the
    first segment, where the counters began at 0,

        prompts acked without a group + trajectory entries acked
            = trained + dropped stale + dead-lettered

    (prompts dead-lettered are on the left, trajectory entries dead-lettered among those
    acked). Later segments begin from counters admission seeded again, and count the groups
    the trainer held through the loss and settled in them: there the untraced prompts must only
    fit the segment's drops and dead letters."""
    ledger = Ledger()
    prompts, trajectories = keys.prompts, keys.trajectories
    for index, seg in enumerate(segments):
        # Each segment on its own: ids do not survive a loss of Redis's data.
        real_prompts = {i for i in seg.prompts if (prompts, i) not in injected}
        group_of = {
            i: g for i, g in seg.trajectories.items() if (trajectories, i) not in injected and g
        }
        queued = {i for s, i in seg.queued if s == prompts}
        dead: dict[str, set[str]] = {prompts: set(), trajectories: set()}
        for stream, entry_id, reason in seg.dlq:
            ledger.reasons[reason] += 1
            if (stream, entry_id) in injected:
                ledger.rejected[stream, entry_id] = reason
                continue
            dead.setdefault(stream, set()).add(entry_id)
            if reason != "max_deliveries":
                ledger.violations.append(
                    ("dead_letters", f"{entry_id} dead-lettered for {reason!r}")
                )
        answered = set(group_of.values())
        ledger.published.update(group_of.values())
        for what, ids in (
            ("groups of unknown prompts", answered - real_prompts),
            ("prompts published and dead-lettered", answered & dead[prompts]),
        ):
            if ids:
                ledger.violations.append(("nothing_lost", f"{what}: {sorted(ids)[:5]}"))
        untraced = len(real_prompts - answered - dead[prompts] - queued)
        ledger.untraced += untraced
        c = seg.counters
        if index == 0:
            acked = len(set(group_of) - {i for s, i in seg.queued if s == trajectories})
            ended = untraced + len(dead[prompts]) + acked
            counted = c.groups_trained + c.groups_dropped_stale + c.groups_dead_lettered
            ledger.unrecorded_dead_letters = max(
                0, c.groups_dead_lettered - len(dead[prompts]) - len(dead[trajectories])
            )
        else:
            ended = untraced
            counted = min(untraced, c.groups_dropped_stale + c.groups_dead_lettered)
        if ended != counted:
            ledger.lost += max(0, ended - counted)
            ledger.violations.append(
                (
                    "nothing_lost",
                    f"segment {index}: {ended} groups ended ({untraced} prompts acked with no "
                    f"trajectory entry or dead letter), {counted} counted trained, dropped stale "
                    "or dead-lettered",
                )
            )
    return ledger


@dataclass
class Exit:
    """A role that exited without being told to."""

    role: str
    code: int | None
    at_s: float
    frames: list[str]
    """`path:function` of the asyncrl frames of its last traceback, innermost last."""
    last_line: str


@dataclass
class Chaos:
    seconds: float
    workers: int
    trainer_ranks: int
    seed: int
    workdir: Path
    model: Path
    progress_timeout_s: float
    say: Callable[[str], object]
    max_faults: int
    weights: str
    deck_makeup: dict[str, int]
    task: str
    stale_policy: str
    violations: list[dict[str, str]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    exits: list[Exit] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    max_queued: int = 0
    segments: list[Segment] = field(default_factory=list)
    """Redis's history up to each `redis_empty` fault (the last segment is read at the end)."""
    injected: dict[tuple[str, str], tuple[str, frozenset[str]]] = field(default_factory=dict)
    """(stream, entry id) → (kind, dead-letter reasons allowed) of every entry added as an
    outsider."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        # Kinds come from their own generator, so the fault sequence depends on the seed only,
        # not on how the other draws (which worker, how long Redis stays down) fell.
        self.kind_rng = random.Random(self.seed)
        self.deck: list[str] = []
        self.run_dir = self.workdir / "run"
        self.logs = self.workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.keys = Keys(RUN_ID)
        self.G = G * self.trainer_ranks
        self.queued_bound = (MAX_STALENESS + 1 + CHECKPOINT_EVERY) * self.G
        self.redis = RedisServer(
            data_dir=self.workdir / "redis", extra_args=["--appendfsync", "always"]
        )
        self.tail = JsonlTail(self.run_dir / "metrics.jsonl")
        self.t0 = time.monotonic()
        self.children: dict[str, Child] = {}
        self.generation: Counter[str] = Counter()
        self.vocab = int(json.loads((self.model / "config.json").read_text())["vocab_size"])

    # -- processes -----------------------------------------------------------------------------

    def _argv(self, role: str, *extra: str) -> list[str]:
        launcher = [sys.executable]
        if role == "trainer" and self.trainer_ranks > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone"]
            launcher += [f"--nproc-per-node={self.trainer_ranks}"]
        cli = ["-m", "asyncrl", "launch", "--role", role, "--config", str(self.config)]
        return [*launcher, *cli, *extra]

    def _worker_id(self, slot: str) -> str:
        return f"{slot}-g{self.generation[slot]}"

    def _worker_argv(self, slot: str) -> list[str]:
        return self._argv("rollout", "--worker-id", self._worker_id(slot))

    def start_cluster(self) -> None:
        self.redis.start()
        self.config = write_config(
            self.workdir / "config.yaml",
            settings(
                self.run_dir,
                self.redis.url,
                self.model,
                self.G,
                self.weights,
                self.task,
                self.stale_policy,
            ),
        )
        self.client = redis.Redis.from_url(self.redis.url, socket_timeout=5)
        trainer = Child("trainer", self._argv("trainer"), self.logs / "trainer.log")
        self.children["trainer"] = trainer
        for i in range(self.workers):
            slot = f"w{i}"
            self.children[slot] = Child(slot, self._worker_argv(slot), self.logs / f"{slot}.log")
        for child in self.children.values():
            child.start()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def poll(self) -> None:
        """Read new step lines, sample the admission bound, restart roles that died unasked."""
        for record in self.tail.read_new():
            if not is_eval_record(record):
                self.steps.append(record)
        try:
            c = read_counters(self.client, self.keys)
        except redis.RedisError:
            c = None  # Redis is down: a fault in progress
        if c is not None:
            self.max_queued = max(self.max_queued, c.prompts_released - c.ended)
        for child in self.children.values():
            if child.alive() or child.expected_exit:
                continue
            assert child.proc is not None
            out = child.output()
            lines = out.strip().splitlines()
            exit_ = Exit(
                child.name,
                child.proc.poll(),
                round(self.elapsed(), 1),
                [f"{path}:{fn}" for path, fn in _FRAME.findall(out[out.rfind("Traceback") :])],
                lines[-1][:300] if lines else "",
            )
            self.exits.append(exit_)
            where = " <- ".join(reversed(exit_.frames[-3:]))
            self.violate("roles_survive", f"{child.name} exited with {exit_.code}: {where}")
            child.start()

    def violate(self, check: str, message: str) -> None:
        self.violations.append({"check": check, "message": message})
        self.say(f"VIOLATION [{check}]: {message}")

    # -- faults --------------------------------------------------------------------------------

    def next_kind(self) -> str:
        if not self.deck:
            self.deck = [k for k, n in self.deck_makeup.items() for _ in range(n)]
            self.kind_rng.shuffle(self.deck)
        return self.deck.pop()

    def inject(self) -> Fault:
        kind = self.next_kind()
        held = taken_over = None
        if kind == "worker":
            target = self._victim()
            child = self.children[target]
            child.kill()
            if self.rng.random() < 0.5:
                self.generation[target] += 1
            child.start(self._worker_argv(target))
        elif kind == "trainer":
            target = "trainer"
            self.children[target].kill()
            unacked = self._unacked_checkpoint()
            self.children[target].start()
        elif kind == "redis":
            target = f"redis:{self.redis.port}"
            self.redis.kill()
            time.sleep(self.rng.uniform(0.2, 3.0))
            self._restart_redis()
        elif kind == "redis_empty":
            target = f"redis:{self.redis.port}"
            self._wipe_redis()
        elif kind == "redis_full":
            target = f"redis:{self.redis.port}"
            self._fill_redis()
        elif kind == "freeze":
            target = self._holder()
            held, taken_over = self._freeze(target)
        else:
            target = "streams"
            self._add_hostile()
        fault = Fault(kind, target, round(self.elapsed(), 1), held=held, taken_over=taken_over)
        if kind == "trainer":
            fault.unacked_checkpoint = unacked
        self.faults.append(fault)
        self.say(f"[{fault.at_s:6.1f}s] fault {len(self.faults)}: {kind} {target}")
        return fault

    def _victim(self) -> str:
        """A rollout worker's slot; a worker still importing torch after its last restart makes
        a dull victim."""
        slots = [n for n in self.children if n != "trainer"]
        ready = [n for n in slots if self.children[n].ready()]
        return self.rng.choice(ready or slots)

    def _holder(self) -> str:
        """A ready worker's slot that holds prompts, waiting for one (up to the progress
        timeout); else any worker's."""
        give_up = time.monotonic() + self.progress_timeout_s
        while time.monotonic() < give_up:
            slots = [n for n in self.children if n != "trainer" and self.children[n].ready()]
            holders = [n for n in slots if self._pending_on(self._worker_id(n))]
            if holders:
                return self.rng.choice(holders)
            self.poll()
            time.sleep(POLL_S)
        return self._victim()

    def _pending_on(self, worker_id: str) -> set[str]:
        rows = self.client.xpending_range(
            self.keys.prompts, PROMPTS_GROUP, "-", "+", 10**6, consumername=worker_id
        )
        return {r["message_id"].decode() for r in cast(list[dict[str, Any]], rows)}

    def _freeze(self, slot: str) -> tuple[int, int]:
        """SIGSTOP a worker past its heartbeat and `claim_idle_s`, until every prompt it held has
        left it (the other workers take them over), then SIGCONT it: it wakes with episodes of
        prompts no longer its own, whose results (groups, dead letters, stale drops) must all be
        refused. (held, taken over); a lone worker is resumed after the same wait."""
        worker_id = self._worker_id(slot)
        held = self._pending_on(worker_id)
        child = self.children[slot]
        child.freeze()
        try:
            lapsed = time.monotonic() + HEARTBEAT_TTL_S + CLAIM_IDLE_S + self.rng.uniform(0.5, 3)
            give_up = time.monotonic() + self.progress_timeout_s
            alone = self.workers == 1
            left: set[str] = set()
            while time.monotonic() < give_up:
                self.poll()
                left = held - self._pending_on(worker_id)
                if time.monotonic() >= lapsed and (alone or left == held):
                    break
                time.sleep(POLL_S)
            else:
                self.violate(
                    "takeover",
                    f"{worker_id} frozen {self.progress_timeout_s:.0f}s: "
                    f"{len(held) - len(left)} of its {len(held)} prompts not taken over",
                )
        finally:
            child.thaw()
        return len(held), len(left)

    def _restart_redis(self) -> None:
        port = self.redis.port
        self.redis.start()
        if self.redis.port != port:
            raise RuntimeError(f"redis came back on port {self.redis.port}, not {port}")

    def _wipe_redis(self) -> None:
        """SIGKILL Redis, keep what it held as a segment (read from its data by a second server
        on another port, so no role sees it), and restart it empty on the same port."""
        self.redis.kill()
        held = self.redis.data_dir.rename(self.workdir / f"redis-lost-{len(self.segments)}")
        with RedisServer(data_dir=held, extra_args=["--appendfsync", "always"]) as side:
            client = redis.Redis.from_url(side.url, socket_timeout=5)
            self.segments.append(read_segment(client, self.keys))
            client.close()
        self._restart_redis()

    def _fill_redis(self) -> None:
        """Redis at its memory limit: maxmemory just above what it uses, then junk until it
        refuses; held full for a while (the roles pause their writes and dead-letter the junk),
        then the limit is lifted."""
        used = int(cast(dict[str, Any], self.client.info("memory"))["used_memory"])
        self.client.config_set("maxmemory", used + 4 * JUNK_BYTES)
        try:
            for _ in range(15):
                junk = {"data": os.urandom(JUNK_BYTES), "schema": b"1"}
                entry_id = cast(bytes, self.client.xadd(self.keys.trajectories, junk)).decode()
                self.injected[self.keys.trajectories, entry_id] = ("junk", _UNDECODABLE)
        except redis.exceptions.OutOfMemoryError:
            pass  # full: what this fault is for
        deadline = time.monotonic() + self.rng.uniform(2.0, 4.0)
        while time.monotonic() < deadline:
            self.poll()
            time.sleep(POLL_S)
        self.client.config_set("maxmemory", 0)

    def _add_hostile(self) -> None:
        stream = self.keys.trajectories
        skip = {(stream, i) for i in _queued(self.client, stream, TRAJECTORIES_GROUP)}
        skip |= set(self.injected)
        rows = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrevrange(stream, count=50))
        acked = next((r for r in rows if (stream, r[0].decode()) not in skip), None)
        for kind, suffix, fields, allowed in hostile_entries(self.vocab, acked):
            stream = self.keys.prefix + suffix
            entry_id = cast(bytes, self.client.xadd(stream, fields)).decode()
            self.injected[stream, entry_id] = (kind, allowed)

    def _final_checkpoint(self) -> int:
        ckpts = list_checkpoints(self.run_dir / "checkpoints")
        return int(ckpts[-1].name.removeprefix("step_")) if ckpts else 0

    def _unacked_checkpoint(self) -> int | None:
        """The newest checkpoint's step if its groups are not all counted trained (acked)."""
        step = self._final_checkpoint()
        trained = read_counters(self.client, self.keys).groups_trained
        return step if trained < step * self.G else None

    def _last_step(self) -> bytes | None:
        try:
            return cast(bytes | None, self.client.get(self.keys.last_step))
        except redis.RedisError:
            return None

    def wait_progress(self, fault: Fault | None) -> bool:
        """Wait until the trainer finishes a step and writes it to Redis (`last_step`) after
        the fault; False, and a violation, if none comes in time. A new line in metrics.jsonl
        alone would not do: a step may run through a Redis outage without touching Redis."""
        before = self._last_step()
        deadline = time.monotonic() + self.progress_timeout_s
        while time.monotonic() < deadline:
            self.poll()
            now = self._last_step()
            if now is not None and now != before:
                if fault is not None:
                    fault.recovered_after_s = round(self.elapsed() - fault.at_s, 1)
                return True
            time.sleep(POLL_S)
        after = f"fault {len(self.faults)} ({fault.kind})" if fault else "start-up"
        self.violate("progress", f"no step within {self.progress_timeout_s:.0f}s after {after}")
        return False

    def run(self) -> dict[str, Any]:
        try:
            self.start_cluster()
            self.say(f"cluster up: {self.redis.url}, {self.workers} workers, logs in {self.logs}")
            ok = self.wait_progress(None)
            started = time.monotonic()
            while ok and time.monotonic() - started < self.seconds:
                if self.max_faults and len(self.faults) >= self.max_faults:
                    break
                ok = self.wait_progress(self.inject())
            if ok:
                self.drain()
            return self.check()
        finally:
            for child in self.children.values():
                child.kill()
            self.redis.stop()

    def drain(self) -> None:
        """Workers first (each publishes the batch in hand), then the trainer (it checkpoints
        and acks what it trained; the groups of an unfinished step stay pending)."""
        for name, child in self.children.items():
            if name != "trainer" and child.stop(60.0) is None:
                self.violate("drain", f"{name} did not exit within 60s of SIGTERM")
        self.poll()
        code = self.children["trainer"].stop(120.0)
        if code != 0:
            self.violate("drain", f"the trainer exited with {code} after SIGTERM")
        self.poll()

    # -- checks --------------------------------------------------------------------------------

    def check(self) -> dict[str, Any]:
        final = read_segment(self.client, self.keys)
        segments = [*self.segments, final]
        counters = final.counters
        balanced = counters.is_balanced(final.in_flight)
        if not balanced:
            self.violate("balanced", f"{counters} in flight {final.in_flight}")

        ledger = account(segments, self.injected, self.keys)
        for check, message in ledger.violations:
            self.violate(check, message)
        ended = ledger.ended(counters, final.in_flight)
        if sum(ended.values()) != counters.prompts_released:
            self.violate("balanced", f"released {counters.prompts_released}, ended {ended}")
        queued_at_end = set().union(*(seg.queued for seg in segments))
        for entry, (kind, allowed) in self.injected.items():
            reason = ledger.rejected.get(entry)
            entry_id = entry[1]
            if reason is None and entry not in queued_at_end and kind != "junk":
                # Junk is dead-lettered in a full Redis, which may refuse the record (the entry
                # is acked regardless): only the other kinds must leave one.
                self.violate("hostile", f"{kind} entry {entry_id}: no dead letter, not queued")
            elif reason is not None and reason not in allowed:
                self.violate("hostile", f"{kind} entry {entry_id} dead-lettered for {reason!r}")
        if not self.segments:
            # One unbroken history: the counters of what entered the streams match it too.
            expected = {
                RunCounter.PROMPTS_RELEASED: len(
                    [i for i in final.prompts if (self.keys.prompts, i) not in self.injected]
                ),
                RunCounter.GROUPS_PUBLISHED: sum(
                    (self.keys.trajectories, i) not in self.injected for i in final.trajectories
                ),
                RunCounter.ENTRIES_REJECTED: len(ledger.rejected),
            }
            for name, n in expected.items():
                if counters[name] != n:
                    self.violate("nothing_lost", f"{name}={counters[name]}, but {n} entries")
        twice = sorted(g for g, n in ledger.published.items() if n > 1)
        if twice:
            self.violate("no_double_training", f"prompts with two trajectory groups: {twice[:5]}")

        final_step = self._final_checkpoint()
        trained_ok = counters.groups_trained == final_step * self.G
        if not trained_ok:
            self.violate(
                "no_double_training",
                f"groups_trained={counters.groups_trained}, but the surviving lineage has "
                f"{final_step} steps × {self.G} groups",
            )
        versions = [int(s["version"]) for s in self.steps]
        reused = [b for a, b in pairwise(versions) if b <= a]
        if reused:
            self.violate("versions", f"step versions not increasing: {reused[:5]} after lower")
        last_line = self.steps[-1]["step"] if self.steps else 0
        if last_line != final_step:
            self.violate("drain", f"last step line {last_line}, final checkpoint {final_step}")
        max_staleness = max((int(s.get("staleness_max") or 0) for s in self.steps), default=0)
        if self.stale_policy == "drop" and max_staleness > MAX_STALENESS:
            self.violate("staleness", f"staleness {max_staleness} trained, η={MAX_STALENESS}")
        if self.stale_policy == "train" and counters.groups_dropped_stale:
            self.violate("staleness", f"{ended} under stale_policy train: a group dropped stale")
        if self.max_queued > self.queued_bound:
            self.violate("admission", f"{self.max_queued} queued, bound {self.queued_bound}")

        return {
            "seconds": round(self.elapsed(), 1),
            "faults": dict(Counter(f.kind for f in self.faults)),
            "fault_log": [asdict(f) for f in self.faults],
            "slowest_recovery_s": max((f.recovered_after_s or 0.0 for f in self.faults), default=0),
            "exits": [asdict(e) for e in self.exits],
            "step_lines": len(self.steps),
            "final_step": final_step,
            "counters": counters.as_dict(),
            "streams": final.streams,
            "in_flight": final.in_flight,
            "redis_lost_data": len(self.segments),
            "hostile_entries": dict(Counter(kind for kind, _ in self.injected.values())),
            "dead_letter_reasons": dict(ledger.reasons),
            "ended": ended,
            "stale_policy": self.stale_policy,
            "balanced": balanced,
            "lost": ledger.lost,
            "double_trained": bool(twice) or not trained_ok,
            "versions_reused": bool(reused),
            "late_results_refused": sum(
                c.log.read_text(errors="replace").count(_REFUSED)
                for name, c in self.children.items()
                if name != "trainer"
            ),
            "killed_before_ack": [
                f.unacked_checkpoint for f in self.faults if f.unacked_checkpoint is not None
            ],
            "max_queued": self.max_queued,
            "queued_bound": self.queued_bound,
            "max_staleness": max_staleness,
            "max_staleness_bound": MAX_STALENESS,
            "violations": self.violations,
            "ok": not self.violations,
        }


def run_chaos(
    seconds: float,
    workers: int = 3,
    trainer_ranks: int = 1,
    seed: int = 0,
    *,
    workdir: Path | None = None,
    model: Path | None = None,
    max_faults: int = 0,
    deck: dict[str, int] | None = None,
    weights: str = "broadcast",
    task: str = "arithmetic",
    stale_policy: str = "train",
    progress_timeout_s: float = 120.0,
    say: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Run the soak and return its summary (see `Chaos.check`), also written to
    `workdir/summary.json`. Faults stop after `seconds`, or after `max_faults` if that comes
    first. `deck`: fault kinds per shuffled deck (default `DECK`); `task`: a key of `TASKS`;
    `stale_policy`: the run's `algo.stale_policy`.
    `model`: an untrained tiny
    model directory, made in `workdir` if not given."""
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix="asyncrl-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if model is None:
        from asyncrl.tiny_model import save_random_tiny_model

        model = workdir / "model"
        if not (model / "config.json").exists():
            save_random_tiny_model(model, seed=seed)
    summary = Chaos(
        seconds,
        workers,
        trainer_ranks,
        seed,
        workdir,
        model,
        progress_timeout_s,
        say,
        max_faults,
        weights,
        dict(deck or DECK),
        task,
        stale_policy,
    ).run()
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def _deck(text: str) -> dict[str, int]:
    deck = {k: int(n) for k, _, n in (item.partition("=") for item in text.split(","))}
    if set(deck) - set(DECK) or sum(deck.values()) < 1:
        raise argparse.ArgumentTypeError(f"kinds are {', '.join(DECK)}; at least one fault")
    return deck


def main() -> int:
    parser = argparse.ArgumentParser(
        description="Kill and restart workers, trainer and Redis; check nothing is lost."
    )
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to inject faults")
    parser.add_argument(
        "--faults",
        dest="max_faults",
        metavar="FAULTS",
        type=int,
        default=0,
        help="stop after N faults (0: no limit)",
    )
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--trainer-ranks", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--deck",
        type=_deck,
        default=DECK,
        help="fault kinds per shuffled deck, e.g. worker=4,trainer=2,redis=2 (the default)",
    )
    parser.add_argument("--weights", choices=["broadcast", "store"], default="broadcast")
    parser.add_argument(
        "--task", choices=list(TASKS), default="arithmetic", help="agentic: 3-turn episodes"
    )
    parser.add_argument("--stale-policy", choices=["train", "drop"], default="train")
    parser.add_argument("--progress-timeout-s", type=float, default=120.0)
    parser.add_argument("--workdir", type=Path, help="default: a new temporary directory")
    args = parser.parse_args()
    summary = run_chaos(**vars(args))
    for key in (
        *("seconds", "faults", "slowest_recovery_s", "step_lines", "final_step", "counters"),
        *("streams", "in_flight", "redis_lost_data", "hostile_entries", "dead_letter_reasons"),
        *("stale_policy", "ended"),
        *("balanced", "lost", "double_trained", "versions_reused", "killed_before_ack"),
        "late_results_refused",
        *("max_queued", "queued_bound", "max_staleness", "max_staleness_bound"),
    ):
        print(f"{key:>20}: {json.dumps(summary[key])}")
    for v in summary["violations"]:
        print(f"VIOLATION [{v['check']}]: {v['message']}")
    print("OK" if summary["ok"] else f"FAILED: {len(summary['violations'])} violation(s)")
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
