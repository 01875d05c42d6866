"""Time encode, decode and validate of one trajectory group (asyncrl.protocol).

    python tools/bench_codec.py [--samples 16] [--tokens 1024] [--repeats 2000]

Prints the figures as one JSON object on the last line. Times are medians over `repeats` calls;
MB/s is the encoded message size divided by the median time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncrl.protocol import (
    Sample,
    TrajectoryGroup,
    decode_group,
    decode_groups,
    encode_group,
    validate_group,
)


def make_group(n_samples: int, n_tokens: int, seed: int = 0) -> TrajectoryGroup:
    """A realistic group: random ids and logprobs, one weight swap halfway through each sample."""
    rng = np.random.default_rng(seed)
    versions = np.full(n_tokens, 7, dtype=np.int32)
    versions[n_tokens // 2 :] = 8
    samples = [
        Sample(
            response_ids=rng.integers(0, 150_000, n_tokens, dtype=np.int32),
            logprobs=-rng.exponential(1.0, n_tokens).astype(np.float32),
            versions=versions,
            reward=float(rng.integers(0, 2)),
            finish="stop",
            meta={"verifier": "math", "turns": 1},
        )
        for _ in range(n_samples)
    ]
    return TrajectoryGroup(
        run="bench",
        group_id="1700000000000-0",
        prompt_id="gsm8k-42",
        release_version=7,
        worker="rollout-0",
        created_at=1.7e9,
        finished_at=1.7e9 + 3.0,
        prompt_ids=rng.integers(0, 150_000, 256, dtype=np.int32),
        samples=samples,
    )


# Entries a trainer reads at once (tools/bench_queue.py's default --batch).
BATCH = 16


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    for _ in range(min(repeats, 50)):  # warm caches and allocator
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_codec(n_samples: int = 16, n_tokens: int = 1024, repeats: int = 2000) -> dict[str, Any]:
    """Median encode/decode/validate times (µs) and throughput (MB/s of encoded bytes).

    decode_us includes validation, since decode_group always validates; validate_us is that part
    alone; batch_decode_us is decode_groups' share of each of `BATCH` entries read at once, as
    the trainer reads them, each_decode_us decode_group's of the same entries one by one.
    """
    group = make_group(n_samples, n_tokens)
    data = encode_group(group)
    encode_s = _median_s(lambda: encode_group(group), repeats)
    decode_s = _median_s(lambda: decode_group(data), repeats)
    batch = [encode_group(make_group(n_samples, n_tokens, seed)) for seed in range(BATCH)]
    calls = max(1, repeats // BATCH)
    batch_s = _median_s(lambda: decode_groups(batch), calls) / BATCH
    # The same entries one by one, timed alike: a call this long is preempted more on a
    # loaded machine than decode_us's.
    each_s = _median_s(lambda: [decode_group(d) for d in batch], calls) / BATCH
    decoded = decode_group(data)
    validate_s = _median_s(lambda: validate_group(decoded, current_version=8), repeats)
    mb = len(data) / 1e6
    return {
        "n_samples": n_samples,
        "n_tokens": n_tokens,
        "message_bytes": len(data),
        "encode_us": round(encode_s * 1e6, 1),
        "decode_us": round(decode_s * 1e6, 1),
        "validate_us": round(validate_s * 1e6, 1),
        "batch_decode_us": round(batch_s * 1e6, 1),
        "each_decode_us": round(each_s * 1e6, 1),
        "encode_mb_s": round(mb / encode_s, 1),
        "decode_mb_s": round(mb / decode_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    print(json.dumps(bench_codec(args.samples, args.tokens, args.repeats)))


if __name__ == "__main__":
    main()
