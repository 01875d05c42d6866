"""A worker in its own process, for the kill tests: it beats, takes `count` entries, logs each
delivery as a JSON line, and then holds them without acking until it is killed.

    python tests/queue_consumer_proc.py URL STREAM GROUP NAME HEARTBEAT_KEY TTL_S LOG COUNT
"""

from __future__ import annotations

import json
import sys
import time

import redis

from asyncrl.heartbeat import Heartbeat
from asyncrl.queue import Consumer


def main() -> None:
    url, stream, group, name, heartbeat_key, ttl_s, log_path, count = sys.argv[1:]
    client = redis.Redis.from_url(url)
    Heartbeat(client, heartbeat_key, float(ttl_s)).start()
    consumer: Consumer[object] = Consumer(
        client, stream, group, name, dlq=f"{stream}:dlq", counters_key=f"{stream}:n", is_alive=bool
    )
    held = 0
    with open(log_path, "a") as log:
        while held < int(count):
            for d in consumer.read(int(count) - held, block_ms=100):
                log.write(json.dumps({"id": d.id, "t": time.time()}) + "\n")
                log.flush()
                held += 1
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
