"""How every role connects to Redis: URL, password (env or file, never logged), TLS, timeouts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from pydantic import model_validator

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
    socket_timeout_s: float = 10.0
    """Socket read timeout. Blocking stream reads use `block_ms`, which must stay below it."""
    connect_timeout_s: float = 5.0
    """TCP/TLS connect timeout."""
    block_ms: int = 1000
    """XREADGROUP BLOCK in milliseconds: short, so loops notice shutdown and Redis outages."""
    reconnect_max_s: float = 5.0
    """Cap of the exponential reconnect backoff while Redis is unreachable."""

    @model_validator(mode="after")
    def _check(self) -> RedisConfig:
        if self.url is not None and urlsplit(self.url).scheme not in ("redis", "rediss"):
            raise ValueError("redis.url must start with redis:// or rediss://")
        if self.block_ms / 1000 >= self.socket_timeout_s:
            raise ValueError("redis.block_ms must be below redis.socket_timeout_s × 1000")
        return self

    def password(self) -> str | None:
        if self.url and urlsplit(self.url).password:
            return None  # the URL carries it; redis-py reads it from there
        if self.password_file is not None:
            return self.password_file.read_text().strip()
        return os.environ.get(self.password_env) or None


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs, `--print-config` and status."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


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
