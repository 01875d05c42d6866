"""Who may call a server of asyncrl's: the run's shared secret, where it is read from, and the
rule that a server without one serves loopback only. Every server takes its callers' key from a
request's head (`Authorization: Bearer <token>`), so a caller without one is refused before
its body is read."""

from __future__ import annotations

import hmac
import ipaddress
import os


class Token:
    """A shared secret, compared in constant time against a request's `Authorization` header."""

    def __init__(self, secret: str | None) -> None:
        self._expected = f"Bearer {secret}".encode() if secret else None

    @property
    def required(self) -> bool:
        return self._expected is not None

    def admits(self, authorization: str | None) -> bool:
        """Whether a request with this `Authorization` header may pass (any, without a secret)."""
        if self._expected is None:
            return True
        return hmac.compare_digest((authorization or "").encode(), self._expected)


def read_token(token_file: str | os.PathLike[str] | None, token_env: str) -> str | None:
    """A server's token: the file's content when given (a mounted Secret), else the environment
    variable's; None when neither holds one. OSError for an unreadable file."""
    if token_file is not None:
        with open(token_file) as f:
            return f.read().strip() or None
    return os.environ.get(token_env) or None


def token_of(token_file: str | os.PathLike[str] | None, token_env: str, key: str) -> str | None:
    """`read_token`, a file it cannot read a config error naming `key` (ValueError)."""
    try:
        return read_token(token_file, token_env)
    except OSError as exc:
        raise ValueError(f"{key} {token_file}: {exc.strerror}") from None


def check_host(host: str, token: str | None, token_env: str) -> None:
    """ValueError unless `host` is loopback or there is a token: nothing beyond this host may
    reach a server unauthenticated."""
    if not token and not is_loopback(host):
        raise ValueError(
            f"--host {host} without a token: set ${token_env} (or --token-env/--token-file) "
            "to a secret shared by the run, or bind to 127.0.0.1"
        )


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
