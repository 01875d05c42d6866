"""How every role connects to Redis: URL, password (env or file, never logged), TLS, timeouts;
and how it rides out Redis being away or full: `RedisGuard`, the retry policy every Redis call of
a role goes through (one per role: it reports outages to the role's metrics and ends its waits
when the role stops), and `MemoryGauge`, which tells a full Redis before it refuses writes.

redis is imported lazily: the config tree imports `RedisConfig`, and `asyncrl --help` must not pay
for redis-py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from pydantic import Field, model_validator

from asyncrl.configbase import Section

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

R = TypeVar("R")

# How Redis says it is full; 6.2 wraps it in a generic script error ("-OOM command not ...").
_OOM_MESSAGE = "OOM command not allowed"
_LOG_EVERY_S = 5.0
_FULL_WAIT_MAX_S = 0.5  # backpressure polls faster than reconnects: memory frees in bursts
_MEMORY_SAMPLE_S = 0.5


class RedisConfig(Section):
    url: str | None = None
    """`redis://host:port/db` or `rediss://` for TLS. Unset: `--role all` starts an embedded
    redis-server in the run directory; the other roles require it."""
    password_env: str = "ASYNCRL_REDIS_PASSWORD"
    """Environment variable read for the password when the URL carries none."""
    password_file: Path | None = None
    """File holding the password (e.g. a mounted Kubernetes Secret); wins over `password_env`."""
    tls_ca_file: Path | None = None
    """CA bundle that signed the server certificate (rediss:// only)."""
    tls_cert_file: Path | None = None
    """Client certificate for mutual TLS (rediss:// only)."""
    tls_key_file: Path | None = None
    """Private key of `tls_cert_file`."""
    socket_timeout_s: float = Field(default=10.0, gt=0)
    """Socket read timeout. Blocking stream reads use `block_ms`, which must stay below it."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """TCP/TLS connect timeout."""
    block_ms: int = Field(default=1000, ge=1)
    """XREADGROUP BLOCK in milliseconds: short, so loops notice shutdown and Redis outages (0
    would be no BLOCK at all: loops spinning on Redis)."""
    reconnect_max_s: float = Field(default=5.0, gt=0)
    """Cap of the exponential reconnect backoff while Redis is unreachable."""

    @model_validator(mode="after")
    def _check(self) -> RedisConfig:
        if self.url is not None and urlsplit(self.url).scheme not in ("redis", "rediss"):
            raise ValueError("redis.url must start with redis:// or rediss://")
        others = [n for n, _ in _query_items(self.url or "") if _is_secret(n) and n != "password"]
        if others:
            # Only `password` is taken out of the URL and handed on by environment; another
            # secret would reach the children's argv.
            raise ValueError(
                f"redis.url: {', '.join(others)} in the query would show in process lists "
                "(only password may be given there)"
            )
        if self.block_ms / 1000 >= self.socket_timeout_s:
            raise ValueError("redis.block_ms must be below redis.socket_timeout_s × 1000")
        return self

    def password(self) -> str | None:
        if self.url and url_password(self.url) is not None:
            return None  # the URL carries it; redis-py reads it from there
        if self.password_file is not None:
            try:
                return self.password_file.read_text().strip()
            except OSError as exc:
                raise RedisAccessError(
                    f"redis.password_file {self.password_file}: {exc.strerror}"
                ) from None
        return os.environ.get(self.password_env) or None

    def password_source(self) -> str:
        """Where the password comes from, for error messages (never the password itself)."""
        if self.url and url_password(self.url) is not None:
            return "the password in redis.url"
        if self.password_file is not None:
            return f"redis.password_file {self.password_file}"
        if os.environ.get(self.password_env):
            return f"${self.password_env}"
        return f"no password (redis.password_file and ${self.password_env} unset)"


class RedisAccessError(Exception):
    """Redis refused this client (password, ACL, TLS certificate) or its secret is unreadable:
    a configuration error, which waiting cannot fix. The message is one line, without secrets."""


def _is_secret(name: str) -> bool:
    """Whether a URL query parameter carries a secret: redis-py hands every query parameter to
    the connection as a keyword argument, `password` and `ssl_password` included."""
    return "password" in unquote(name).lower()


def _query_items(url: str) -> list[tuple[str, str]]:
    """(name, value) of each `name=value` in the URL's query, as written (not decoded)."""
    return [
        (name, value)
        for name, _, value in (item.partition("=") for item in urlsplit(url).query.split("&"))
        if name
    ]


def url_password(url: str) -> str | None:
    """The password redis-py authenticates with from `url`: the userinfo one, else the first
    non-empty `password` query parameter (`redis.connection.parse_url`)."""
    parts = urlsplit(url)
    if parts.password:
        return unquote(parts.password)
    return next((v for k, v in parse_qsl(parts.query) if k == "password"), None)


def _rebuild(url: str, password: str | None) -> str:
    """`url` with its userinfo password set to `password` (None: dropped) and every secret
    query parameter dropped, or shown as `***` when `password` is `***`."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    user = parts.username or ""
    if parts.password is not None and password is not None:
        host = f"{user}:{password}@{host}"
    elif user:
        host = f"{user}@{host}"
    kept = [
        f"{name}={password}" if _is_secret(name) else f"{name}={value}"
        for name, value in _query_items(url)
        if password is not None or not _is_secret(name)
    ]
    return urlunsplit(parts._replace(netloc=host, query="&".join(kept)))


def split_password(url: str) -> tuple[str, str | None]:
    """The URL without any password (userinfo or query), and the password (None when it has
    none): children get the URL in argv and the password by environment."""
    return _rebuild(url, None), url_password(url)


def redact_url(url: str) -> str:
    """The URL with every password (userinfo or query) shown as `***`: the one form used
    wherever a URL is printed, logged or written (`--print-config`, status, errors, config.yaml)."""
    return _rebuild(url, "***")


def with_password(url: str, password: str | None) -> str:
    """`url` carrying `password` in its userinfo, for a launcher's own client (the roles get it
    by environment)."""
    if password is None:
        return url
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f":{quote(password, safe='')}@{parts.netloc}"))


def connect(cfg: RedisConfig, url: str | None = None) -> redis.Redis:
    """A client for `url` (default `cfg.url`) that fails fast on a wrong password.

    Connection errors are left to the callers' own reconnect loops, which log and back off: a
    retry hidden in the client would make an outage look like a hang.
    """
    import redis

    target = url or cfg.url
    if target is None:
        raise ValueError("redis.url is not set")
    kwargs: dict[str, object] = {
        "socket_timeout": cfg.socket_timeout_s,
        "socket_connect_timeout": cfg.connect_timeout_s,
        "health_check_interval": 15,
    }
    password = cfg.password()
    if password is not None:
        kwargs["password"] = password
    if urlsplit(target).scheme == "rediss":
        kwargs["ssl_ca_certs"] = str(cfg.tls_ca_file) if cfg.tls_ca_file else None
        kwargs["ssl_certfile"] = str(cfg.tls_cert_file) if cfg.tls_cert_file else None
        kwargs["ssl_keyfile"] = str(cfg.tls_key_file) if cfg.tls_key_file else None
    return redis.Redis.from_url(target, **kwargs)


def wait_until_reachable(
    client: redis.Redis,
    cfg: RedisConfig,
    url: str | None = None,
    *,
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Return once `client` answers PING. While Redis is unreachable, wait (backoff capped at
    `cfg.reconnect_max_s`, a log line every few seconds): a role may start before Redis or
    during an outage. Refused credentials or a server certificate that fails verification raise
    `RedisAccessError` at once."""
    import ssl

    from redis import exceptions as rx

    where = redact_url(url or cfg.url or "")

    def ping() -> None:
        try:
            client.ping()
        except rx.ConnectionError as exc:
            # redis-py reports TLS failures as ConnectionError; the ssl error is its context.
            if isinstance(exc.__context__, ssl.SSLCertVerificationError):
                raise RedisAccessError(
                    f"redis: TLS certificate of {where} rejected "
                    f"({exc.__context__.verify_message}); check redis.tls_ca_file"
                ) from None
            raise

    guard = RedisGuard(reconnect_max_s=cfg.reconnect_max_s, should_stop=should_stop)
    try:
        guard.call(ping, f"connect to {where}")
    except (rx.AuthenticationError, rx.AuthorizationError) as exc:
        raise RedisAccessError(
            f"redis: {where} refused the client ({exc}); password from {cfg.password_source()}"
        ) from None


class Stopped(Exception):
    """`should_stop` turned true while a call was waiting for Redis (an outage or a full Redis)."""


class RedisGuard:
    """Runs a Redis call until it succeeds, waiting out outages and a full Redis.

    Outages (connection refused or reset, timeouts, a server still loading its AOF) are retried
    with exponential backoff capped at `reconnect_max_s`; `on_outage(True)` and `on_outage(False)`
    mark the start and end of each, so metrics can show Redis being down, and `outages` counts
    them. A refused password or ACL is raised at once, not waited out. A full Redis (an OOM reply,
    or memory above the watermark of a `MemoryGauge`) pauses the call the same way. Waits log at
    most every few seconds and poll `should_stop`, which ends them with `Stopped`: it is asked only
    once an attempt has failed, so a stopping role still makes its last calls to a healthy Redis,
    but does not wait out an outage. A role builds one guard and passes it to its queue clients
    (`guard=`), and its threads share it (the trainer's reader and main loop do): an outage is
    counted once, started by the first call that fails and ended by the first that succeeds.
    """

    def __init__(
        self,
        *,
        reconnect_max_s: float = 5.0,
        should_stop: Callable[[], bool] | None = None,
        on_outage: Callable[[bool], None] | None = None,
    ) -> None:
        from redis import exceptions as rx

        self._transient: tuple[type[Exception], ...] = (rx.ConnectionError, rx.TimeoutError)
        # redis-py derives these from ConnectionError, but a refused password or ACL stays
        # refused: retrying would turn a configuration error into a silent hang.
        self._refused: tuple[type[Exception], ...] = (
            rx.AuthenticationError,
            rx.AuthorizationError,
        )
        self._response = rx.ResponseError
        self._max_s = reconnect_max_s
        self._should_stop = should_stop
        self._on_outage = on_outage
        self._next_log = 0.0  # shared by all calls: a producer pausing at every add logs rarely
        self._lock = threading.Lock()
        self.outages = 0
        self.down = False
        """True while the current call is failing because Redis is unreachable."""

    def call(
        self,
        fn: Callable[[], R],
        what: str,
        *,
        memory: MemoryGauge | None = None,
        on_retry: Callable[[bool], None] | None = None,
    ) -> R:
        """`fn()`, retried until it succeeds. Before each retry `on_retry(outage)` learns whether
        the failed attempt was an outage (True: its outcome is unknown) or a full Redis (False)."""
        delay = 0.05
        started = time.monotonic()
        waiting = False
        while True:
            if waiting and self._should_stop is not None and self._should_stop():
                raise Stopped(what)
            waiting = True
            try:
                if memory is None or not memory.full():
                    result = fn()
                    break
                reason = f"Redis memory above {memory.watermark:.0%} of maxmemory"
                outage = False
            except self._refused:
                raise
            except self._transient as exc:
                reason, outage = f"Redis unreachable ({type(exc).__name__}: {exc})", True
                self._mark_down(True, what, started)
            except self._response as exc:
                if not is_oom(exc):
                    raise
                reason, outage = "Redis is out of memory", False
            now = time.monotonic()
            if now >= self._next_log:
                verb = "retrying" if outage else "pausing"
                log.warning("%s: %s; %s (%.0fs so far)", what, reason, verb, now - started)
                self._next_log = now + _LOG_EVERY_S
            if on_retry is not None:
                on_retry(outage)
            self._sleep(delay)
            delay = min(delay * 2, self._max_s if outage else _FULL_WAIT_MAX_S)
        if self.down:
            self._mark_down(False, what, started)
        return result

    def _mark_down(self, down: bool, what: str, started: float) -> None:
        with self._lock:
            if self.down == down:
                return  # another thread saw this transition first
            self.down = down
            if down:
                self.outages += 1
            else:
                log.warning(
                    "%s: Redis reachable again after %.1fs", what, time.monotonic() - started
                )
            if self._on_outage is not None:
                self._on_outage(down)

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if self._should_stop is not None and self._should_stop():
                return
            time.sleep(min(left, 0.1))


def is_oom(exc: Exception) -> bool:
    """Whether a Redis error says that Redis is full (`maxmemory` reached, nothing to evict)."""
    from redis import exceptions as rx

    return isinstance(exc, rx.OutOfMemoryError) or _OOM_MESSAGE in str(exc)


class MemoryGauge:
    """Whether Redis memory is above `watermark` × maxmemory.

    INFO is sampled at most every 0.5 s, plus whenever the bytes this process has added since the
    last sample would cross the watermark: a fast producer must not overshoot it between samples.
    A user the ACL refuses INFO (it is @dangerous, and no other permitted command tells
    maxmemory) leaves the gauge unknown, never full: Redis's own out-of-memory refusal, which
    `RedisGuard` waits out, is then the only brake.
    """

    def __init__(self, client: redis.Redis, watermark: float) -> None:
        self._client = client
        self.watermark = watermark
        self._used = 0
        self._limit = 0.0  # 0: no maxmemory (or unknown), never full
        self._added = 0
        self._next_sample = 0.0

    def full(self) -> bool:
        now = time.monotonic()
        near = self._limit and self._used + self._added >= self._limit
        if now >= self._next_sample or near:
            self._sample(now)
        return bool(self._limit) and self._used + self._added >= self._limit

    def _sample(self, now: float) -> None:
        from redis.exceptions import NoPermissionError

        try:
            info = self._client.info("memory")
        except NoPermissionError:
            log.warning(
                "redis: this user may not run INFO; queue.memory_high_watermark is off (memory "
                "unknown), writes pause only when Redis itself refuses them for memory"
            )
            self._next_sample = float("inf")
            return
        self._used = int(info["used_memory"])
        self._limit = self.watermark * int(info.get("maxmemory", 0))
        self._added = 0
        self._next_sample = now + _MEMORY_SAMPLE_S

    def added(self, nbytes: int) -> None:
        self._added += nbytes
