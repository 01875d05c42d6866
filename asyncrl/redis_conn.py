"""How every role connects to Redis: URL, password (env or file, never logged), TLS, timeouts."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from pydantic import Field, model_validator

from asyncrl.configbase import Section

if TYPE_CHECKING:
    import redis


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

    from asyncrl.queue import RedisGuard

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
