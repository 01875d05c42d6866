"""Shared fixtures: a real redis-server per test that needs one, started and stopped here."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from asyncrl.launch.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(data_dir=tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    try:
        yield client
    finally:
        client.close()
