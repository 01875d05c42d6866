"""`StreamClient`: what the producer and the consumers of one stream share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.queue.config import QueueConfig
from asyncrl.queue.scripts import TRANSACT_LUA
from asyncrl.redis_conn import MemoryGauge, RedisGuard

if TYPE_CHECKING:
    import redis
    from redis.commands.core import Script


@dataclass(frozen=True, slots=True)
class StreamClient:
    """One stream as its producer or a consumer uses it: the client, the stream's key, the
    config, the guard that waits out outages and a full Redis (the role's, where it passed one),
    the gauge that tells a full Redis, and the transaction script (`scripts.TRANSACT_LUA`)."""

    client: redis.Redis
    stream: str
    cfg: QueueConfig
    guard: RedisGuard
    memory: MemoryGauge
    script: Script

    @classmethod
    def open(
        cls,
        client: redis.Redis,
        stream: str,
        cfg: QueueConfig | None = None,
        guard: RedisGuard | None = None,
    ) -> StreamClient:
        check_client(client)
        cfg = cfg or QueueConfig()
        return cls(
            client,
            stream,
            cfg,
            guard or RedisGuard(),
            MemoryGauge(client, cfg.memory_high_watermark),
            client.register_script(TRANSACT_LUA),
        )


def check_client(client: redis.Redis, block_ms: int | None = None) -> None:
    kwargs = client.connection_pool.connection_kwargs
    if kwargs.get("decode_responses"):
        raise ValueError("the queue needs a client without decode_responses: payloads are bytes")
    timeout = kwargs.get("socket_timeout")
    if block_ms and timeout is not None and block_ms / 1000 >= timeout:
        raise ValueError(f"block_ms={block_ms} must stay below the socket timeout ({timeout}s)")
