"""The gateway's sessions: one per agent episode, each with its own credential, its transcript
and the calls it has waiting on the engine.

A call's HTTP thread hands its prompt to its episode (`post`, given when the session opened)
and waits; the episode bounds it by its budget and awaits it as a turn, batched with every
other ready turn, and the call is resolved with the engine's `Generation`, or refused. Ending
a session (its episode returned, failed or was given up) refuses what waits at once and every
later call with the reason, so an agent's call never hangs on an episode that is gone. Calls of
one session run one at a time, in arrival order: its transcript needs each call recorded
before the next is planned.
"""

from __future__ import annotations

import math
import numbers
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncrl.engines.base import Generation

if TYPE_CHECKING:
    from asyncrl.gateway.transcript import Transcript

Reward = float | list[float] | None
"""What an agent's episode may be rewarded with: a number, one per call, or None (the task's
reward then scores its last answer)."""

_ENDED_KEPT = 4096
"""Ended sessions remembered, so that a late call hears why rather than an unknown key."""


class SessionEnded(Exception):
    """A call of a session that is over (or refused by its episode): `str()` says why."""


@dataclass(eq=False)
class PendingCall:
    """One call waiting on the engine."""

    prompt_ids: list[int]
    max_new_tokens: int
    """The call's own bound (`max_tokens`); its episode cuts it to what the run's sampling,
    the episode's budget and the context leave."""
    _done: threading.Event = field(default_factory=threading.Event)
    _gen: Generation | None = None
    _refused: str | None = None

    def resolve(self, gen: Generation) -> None:
        self._gen = gen
        self._done.set()

    def refuse(self, why: str) -> None:
        if not self._done.is_set():
            self._refused = why
            self._done.set()

    def wait(self) -> Generation:
        self._done.wait()
        if self._gen is None:
            raise SessionEnded(self._refused or "refused")
        return self._gen


@dataclass(eq=False)
class Session:
    """One episode's credential and transcript; `post` hands a call to its episode."""

    token: str
    transcript: Transcript
    post: Callable[[PendingCall], None]
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by a call from its plan to its record."""
    ended: str | None = None
    last_content: str = ""
    """The content of the last reply, which the task's reward scores when the agent returns
    no reward."""
    posted: Reward = None
    """The reward the agent POSTed to `{base_url}/reward`, used when it returns none."""
    _waiting: set[PendingCall] = field(default_factory=set)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def generate(self, call: PendingCall) -> Generation:
        """Hand `call` to its episode and wait for its generation (`SessionEnded` if the
        session ends first or the episode refuses it)."""
        with self._guard:
            if self.ended is not None:
                raise SessionEnded(self.ended)
            self._waiting.add(call)
        try:
            self.post(call)
            return call.wait()
        finally:
            with self._guard:
                self._waiting.discard(call)

    def end(self, why: str) -> None:
        with self._guard:
            if self.ended is None:
                self.ended = why
            waiting, self._waiting = self._waiting, set()
        for call in waiting:
            call.refuse(why)


class Sessions:
    """The live sessions by credential, and the recently ended ones (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, Session] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()

    def open(self, transcript: Transcript, post: Callable[[PendingCall], None]) -> Session:
        session = Session(secrets.token_urlsafe(24), transcript, post)
        with self._lock:
            self._live[session.token] = session
        return session

    def close(self, session: Session, why: str) -> None:
        """End `session` (refusing its calls with `why`) and forget its credential."""
        session.end(why)
        with self._lock:
            self._live.pop(session.token, None)
            self._ended[session.token] = session.ended or why
            while len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)

    def find(self, token: str) -> Session | str | None:
        """The live session of `token`; why it ended, for a recent one; None: unknown."""
        with self._lock:
            return self._live.get(token) or self._ended.get(token)

    def close_all(self, why: str) -> None:
        with self._lock:
            live = list(self._live.values())
        for session in live:
            self.close(session, why)

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)


def parse_reward(value: object) -> Reward:
    """`value` if it is a reward an agent may give, else ValueError saying why."""

    def number(x: object) -> bool:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)

    if value is None or number(value):
        return None if value is None else float(value)  # type: ignore[arg-type]
    if isinstance(value, list | tuple) and value and all(number(x) for x in value):
        return [float(x) for x in value]
    raise ValueError(f"returned {value!r:.200}: expected a finite number, a list of them or None")
