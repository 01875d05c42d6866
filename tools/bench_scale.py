"""Cost at scale: a ladder of model sizes through asyncrl's own code, each beside a raw baseline.

    .venv/bin/python tools/bench_scale.py [--sizes 1m,10m,50m,150m] [--rounds 3]
        [--parts broadcast,store,checkpoint,train,queue,delta] [--engine-dtype float32|bfloat16]
        [--train-tokens 512] [--logits-chunk-tokens N] [--queue-tokens 256,1024,4096,16384]
        [--lrs 1e-6,1e-5,1e-4] [--plot docs/scale]

Models are random Qwen2 models built from a config (tied embeddings, as Qwen2.5-0.5B): `1m`, `10m`
and `50m` with a 32 k vocabulary, `150m` and `500m` (Qwen2.5-0.5B's shape) with Qwen's 151 936.
Every (size, part) runs in a child process of its own, so that its peak RSS (VmHWM) is its own;
each child's RSS after its imports, before any model exists, is the fixed overhead it reports.
Within a part asyncrl and the baseline alternate, round by round, after one warm-up round each,
and the figures are medians.

- broadcast: `BroadcastPublisher.publish` of the model's parameters (fp32 masters) to one
  receiver process whose `BroadcastSubscriber` stages them into a `TorchEngine` of
  `--engine-dtype`; timed from publish until the receiver's engine holds the version (`sync_s`:
  the receiver's check and the engine's copy included; `send_s` is the publisher's own
  `weight_sync_seconds`, until the last bucket left). Raw: one `broadcast` of a flat uint8
  tensor of the same bytes over a plain gloo group to another process. Trainer blocking is
  `publish()` plus `copied()` once the version is held, where the trainer's optimizer step
  calls it after a forward and backward (`--copy deferred`, the trainer's way), or the copy
  inside `publish()` (`--copy inline`).
- store: `StorePublisher` → `StoreSubscriber` (safetensors file, fsync, announce, load,
  checksum, stage), timed the same way. Raw: `safetensors.torch.save_file` + fsync +
  `load_file` of the same tensors.
- checkpoint: `parallel.full_state` + `checkpoint.save_checkpoint` of the model and its AdamW
  state (one step taken); resume = `from_pretrained` + `load_checkpoint` into a new AdamW.
  Raw: `torch.save` of both state dicts + fsync; resume = `from_config` + `torch.load` +
  `load_state_dict` of both.
- train: `trainer.step.train_step` (the decoupled objective, truncated IS, clip, AdamW) on
  rows of random tokens against a bare loop on the same model, optimizer and batch (forward,
  log-softmax gather, policy-gradient loss, backward, clip, step), AdamW on the trainer's
  kernel (`trainer.builder.adamw_kernel`). MFU = 6 × parameters × tokens/s over the peak FLOP/s
  of an fp32 matmul measured here. Trainer RSS: the peak of the first step (which allocates the
  Adam state) and the steady one, of the later steps (with the Adam state already there), with
  glibc set up as the trainer sets it (`device.return_freed_memory`). `train_step` computes the
  head in chunks of `--logits-chunk-tokens` (default: `trainer.logits_chunk_tokens`'s; 0: whole
  logits); the bare loop keeps whole logits.
- delta: (not run by default) delta sync against full sync over broadcast, side by side, at
  each of `--lrs` (`tools/bench_delta.py` says how); rows under "delta".
- queue: (size-independent) trajectory groups of 8 samples at each response length through
  `protocol.stream_fields` + `Producer.add` + `Consumer.read` (decoding and validating) +
  `Consumer.ack`, against redis-py `XADD` / `XREADGROUP` / `XACK` of the same encoded bytes.

The last line is JSON: {"peak_flops": ..., "sizes": {size: {part: {...}}}, "queue": [...],
"delta": [...]}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, int]] = {
    "1m": dict(vocab=32000, hidden=32, layers=1, heads=2, kv=1, inter=64),
    "10m": dict(vocab=32000, hidden=256, layers=2, heads=4, kv=2, inter=688),
    "50m": dict(vocab=32000, hidden=512, layers=12, heads=8, kv=2, inter=1408),
    "150m": dict(vocab=151936, hidden=768, layers=5, heads=12, kv=4, inter=2048),
    "500m": dict(vocab=151936, hidden=896, layers=24, heads=14, kv=2, inter=4864),
}
PARTS = ("broadcast", "store", "checkpoint", "train")
RUN = "scale"
MB = 2**20


def baseline_mb() -> float:
    """Resident memory once torch, transformers' Qwen2 code and torch's thread pools are loaded:
    the fixed overhead a part's figures are taken relative to."""
    import torch
    from transformers import Qwen2ForCausalLM  # noqa: F401

    torch.randn(64, 64) @ torch.randn(64, 64)
    return rss_mb("VmRSS")


def rss_mb(field: str = "VmHWM") -> float:
    """This process' peak (VmHWM) or current (VmRSS) resident memory, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    """Start this process' peak (VmHWM) over from its current resident memory."""
    Path("/proc/self/clear_refs").write_text("5")


def build_model(size: str, dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    s = SIZES[size]
    config = Qwen2Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# ---------------------------------------------------------------------------------------------
# weight sync


def _held_key(worker: str) -> str:
    return f"asyncrl:{RUN}:bench:held:{worker}"


def _raw_group(client: Any, rank: int) -> Any:
    """A plain gloo group of the publisher (rank 0) and one peer on the publisher's TCPStore."""
    import torch
    import torch.distributed as dist

    from asyncrl.runstate import Keys
    from asyncrl.weights.base import text
    from asyncrl.weights.groups import local_addr_towards, new_group

    while (master := client.hget(Keys(RUN).weights, "master")) is None:
        time.sleep(0.05)
    host, port = text(master).rsplit(":", 1)
    timeout = timedelta(seconds=300)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore("bench/raw", store)
    addr = local_addr_towards(host, int(port))
    return new_group("gloo", prefixed, rank, 2, timeout, torch.device("cpu"), addr)


def _raw_broadcast(group: Any, flat: Any) -> float:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    start = time.perf_counter()
    group.broadcast([flat], opts).wait()
    return time.perf_counter() - start


def receiver(args: argparse.Namespace) -> None:
    """A rollout worker's side: a subscriber staging into a TorchEngine, or the raw peer."""
    import signal
    import threading

    import redis
    import torch

    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.rollout.backends import build_subscriber, kept_dtype
    from asyncrl.runstate import Keys
    from asyncrl.weights.config import BroadcastWeightsConfig, StoreWeightsConfig

    client = redis.Redis.from_url(args.redis)
    keys = Keys(args.run)
    if args.transport == "raw":
        group = _raw_group(client, 1)
        flat = torch.empty(args.nbytes, dtype=torch.uint8)
        for _ in range(args.rounds):
            _raw_broadcast(group, flat)
        return
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    base = baseline_mb()
    engine = TorchEngine(build_model(args.size, args.engine_dtype), eos_token_ids=[0])
    model_mb = rss_mb("VmRSS") - base

    def on_weights(tensors: dict[str, torch.Tensor], version: int) -> None:
        engine.stage_weights(tensors, version)  # applied at once: the engine is idle
        report = {"version": version, "hwm_mb": rss_mb(), "base_mb": base, "model_mb": model_mb}
        client.set(_held_key(args.worker), json.dumps(report))

    cfg: Any = (
        BroadcastWeightsConfig(sync_timeout_s=300)
        if args.transport == "broadcast"
        else StoreWeightsConfig(store_dir=Path(args.store_dir), sync_timeout_s=300)
    )
    sub = build_subscriber(
        cfg,
        client,
        keys,
        args.worker,
        device="cpu",
        on_weights=on_weights,
        keeps_dtype=kept_dtype(engine),
    )
    stopping.wait()
    sub.close()


def _wait_held(client: Any, worker: str, version: int) -> dict[str, Any]:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        raw = client.get(_held_key(worker))
        if raw is not None and (held := json.loads(raw))["version"] == version:
            return held
        time.sleep(0.001)
    raise TimeoutError(f"{worker} never held version {version}")


@contextlib.contextmanager
def _processes(cmds: list[list[str]]) -> Iterator[None]:
    procs = [subprocess.Popen(cmd) for cmd in cmds]
    try:
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)


def part_sync(args: argparse.Namespace, transport: str) -> dict[str, Any]:
    import redis
    import torch
    from safetensors.torch import load_file, save_file

    from asyncrl.launch.redis_server import RedisServer
    from asyncrl.runstate import Keys
    from asyncrl.trainer.backends import build_publisher
    from asyncrl.weights.base import SyncRecord, text
    from asyncrl.weights.config import BroadcastWeightsConfig, StoreWeightsConfig

    base = baseline_mb()
    model = build_model(args.size)
    params = [(n, p.detach()) for n, p in model.named_parameters()]
    param_bytes = sum(t.numel() * t.element_size() for _, t in params)
    rounds = args.rounds + 1
    keys = Keys(RUN)
    with tempfile.TemporaryDirectory() as tmp, RedisServer(data_dir=Path(tmp)) as server:
        client = redis.Redis.from_url(server.url)
        records: queue.Queue[SyncRecord] = queue.Queue()
        store_dir = Path(tmp) / "weights"
        cfg: Any = (
            BroadcastWeightsConfig(bucket_mb=args.bucket_mb, sync_timeout_s=300)
            if transport == "broadcast"
            else StoreWeightsConfig(store_dir=store_dir, sync_timeout_s=300, keep_last=2)
        )
        pub = build_publisher(cfg, client, keys, device="cpu", on_record=records.put)
        me = [sys.executable, os.path.abspath(__file__), "--receiver", "--redis", server.url]
        me += ["--size", args.size, "--engine-dtype", args.engine_dtype]
        cmds = [[*me, "--transport", transport, "--worker", "w0", "--store-dir", str(store_dir)]]
        if transport == "broadcast":
            cmds.append([*me, "--transport", "raw", "--rounds", str(rounds)])
            cmds[-1] += ["--nbytes", str(param_bytes)]
        rows: list[tuple[float, float, float, float, float]] = []
        held: dict[str, Any] = {}
        pub_hwm = 0.0
        with _processes(cmds):
            if transport == "broadcast":
                while not any(text(f) == "join:w0" for f in client.hkeys(keys.weights)):
                    time.sleep(0.05)
                group = _raw_group(client, 0)
            for version in range(1, rounds + 1):  # the engine starts at version 0
                start = time.perf_counter()
                blocking_s = pub.publish(params, version, defer_copy=args.copy == "deferred")
                held = _wait_held(client, "w0", version)
                asyncrl_s = time.perf_counter() - start
                # Where the trainer's optimizer step would wait: by then its forward and
                # backward (longer than the copy at every size) have run.
                blocking_s += pub.copied()
                record = records.get(timeout=300)
                assert record.ok, record
                if version == 1:
                    pub_hwm = rss_mb()  # before any raw buffer exists
                if transport == "broadcast":
                    flat = torch.zeros(param_bytes, dtype=torch.uint8)
                    raw_s = _raw_broadcast(group, flat)
                else:
                    path = Path(tmp) / "raw.safetensors"
                    start = time.perf_counter()
                    save_file(dict(params), path)
                    with path.open("rb") as f:
                        os.fsync(f.fileno())
                    load_file(path)
                    raw_s = time.perf_counter() - start
                    path.unlink()
                rows.append((asyncrl_s, raw_s, blocking_s, record.bytes_sent, record.sync_s))
                print(
                    f"  {args.size} {transport} round {version}: asyncrl {asyncrl_s:.3f}s "
                    f"(send {record.sync_s:.3f}s)  raw {raw_s:.3f}s  "
                    f"blocking {blocking_s * 1000:.1f}ms",
                    file=sys.stderr,
                )
        pub.close()
    timed = rows[1:]
    sync_s = median([r[0] for r in timed])
    raw_s = median([r[1] for r in timed])
    blocking_s = median([r[2] for r in timed])
    send_s = median([r[4] for r in timed])
    return {
        "params": sum(t.numel() for _, t in params),
        "param_mb": round(param_bytes / MB, 1),
        "wire_mb": round(median([r[3] for r in timed]) / MB, 1),
        "sync_s": round(sync_s, 4),
        "raw_s": round(raw_s, 4),
        "mb_s": round(param_bytes / MB / sync_s, 1),
        "raw_mb_s": round(param_bytes / MB / raw_s, 1),
        "ratio": round(raw_s / sync_s, 3),
        "send_s": round(send_s, 4),
        "send_ratio": round(raw_s / send_s, 3),
        "blocking_s": round(blocking_s, 4),
        "blocking_frac": round(blocking_s / sync_s, 3),
        "trainer_rss_mb": round(pub_hwm - base, 1),
        "trainer_base_mb": round(base, 1),
        "receiver_rss_mb": round(held["hwm_mb"] - held["base_mb"], 1),
        "receiver_model_mb": round(held["model_mb"], 1),
        "receiver_base_mb": round(held["base_mb"], 1),
    }


# ---------------------------------------------------------------------------------------------
# checkpoint


def _one_step(model: Any, optimizer: Any) -> None:
    import torch

    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def part_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from asyncrl.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint
    from asyncrl.trainer.parallel import full_state

    model = build_model(args.size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _one_step(model, optimizer)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())  # weights + exp_avg(_sq)
    rows: list[tuple[float, float, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "checkpoints"
        raw_path = Path(tmp) / "raw.pt"
        for step in range(args.rounds + 1):
            start = time.perf_counter()
            model_state, optimizer_state = full_state(model, optimizer)
            ts = TrainerState(step=step, version=step, cursor={}, wall_seconds=0.0)
            path = save_checkpoint(
                root, model, model_state, optimizer_state, ts, tokenizer_dir=None, keep=1
            )
            save_s = time.perf_counter() - start
            del model_state, optimizer_state
            start = time.perf_counter()
            from transformers import AutoModelForCausalLM

            resumed = AutoModelForCausalLM.from_pretrained(path)
            resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-4)
            load_checkpoint(path, resumed, resumed_opt)
            resume_s = time.perf_counter() - start
            del resumed, resumed_opt

            start = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, raw_path)
            with raw_path.open("rb") as f:
                os.fsync(f.fileno())
            raw_save_s = time.perf_counter() - start
            start = time.perf_counter()
            fresh = build_model(args.size)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
            loaded = torch.load(raw_path, weights_only=True)
            fresh.load_state_dict(loaded["model"])
            fresh_opt.load_state_dict(loaded["optimizer"])
            raw_resume_s = time.perf_counter() - start
            del fresh, fresh_opt, loaded
            rows.append((save_s, resume_s, raw_save_s, raw_resume_s))
            print(
                f"  {args.size} checkpoint round {step}: save {save_s:.3f}s (raw "
                f"{raw_save_s:.3f}s)  resume {resume_s:.3f}s (raw {raw_resume_s:.3f}s)",
                file=sys.stderr,
            )
    save_s, resume_s, raw_save_s, raw_resume_s = (
        median([r[i] for r in rows[1:]]) for i in range(4)
    )
    return {
        "state_mb": round(state_bytes / MB, 1),
        "save_s": round(save_s, 4),
        "raw_save_s": round(raw_save_s, 4),
        "save_over_raw": round(save_s / raw_save_s, 3),
        "resume_s": round(resume_s, 4),
        "raw_resume_s": round(raw_resume_s, 4),
        "resume_over_raw": round(resume_s / raw_resume_s, 3),
    }


# ---------------------------------------------------------------------------------------------
# train


def peak_flops(n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of an fp32 n×n matmul on this machine (median): the peak MFU is measured against."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * n**3 / median(times[2:])


def _rows(vocab: int, tokens: int, seed: int) -> list[Any]:
    import numpy as np

    from asyncrl.trainer.batch import Row

    rng = np.random.default_rng(seed)
    length, n_prompt = 128, 32
    rows = []
    for i in range(max(1, tokens // length)):
        n_resp = length - n_prompt
        rows.append(
            Row(
                input_ids=rng.integers(0, vocab, length, dtype=np.int64),
                n_prompt=n_prompt,
                behav_logp=-rng.exponential(1.0, n_resp).astype(np.float32) - 10.0,
                versions=np.zeros(n_resp, dtype=np.int32),
                loss_mask=np.ones(n_resp, dtype=np.float32),
                advantage=1.0 if i % 2 else -1.0,
                reward=float(i % 2),
            )
        )
    return rows


def _bare_step(model: Any, optimizer: Any, rows: list[Any]) -> None:
    """What any trainer does: forward, log-probs of the taken tokens, a policy-gradient loss."""
    import numpy as np
    import torch

    ids = torch.from_numpy(np.stack([r.input_ids for r in rows]))
    adv = torch.tensor([r.advantage for r in rows]).unsqueeze(1)
    logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    n_prompt = rows[0].n_prompt
    loss = -(logp[:, n_prompt - 1 :] * adv).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def part_train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from asyncrl.algo.config import AlgoConfig
    from asyncrl.device import return_freed_memory
    from asyncrl.engines.config import SamplingParams
    from asyncrl.trainer.builder import adamw_kernel
    from asyncrl.trainer.step import train_step

    base = baseline_mb()
    return_freed_memory()  # as the trainer does
    model = build_model(args.size)
    n_params = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-6, **adamw_kernel(params))  # the trainer's kernel
    rows = _rows(model.config.vocab_size, args.train_tokens, seed=0)
    tokens = sum(r.length for r in rows)
    flops = args.peak_flops
    asyncrl_t, bare_t = [], []
    trainer_hwm = steady_hwm = 0.0
    for step in range(args.rounds + 1):
        if step:
            reset_peak()  # from here the peak of a step with the Adam state already allocated
        start = time.perf_counter()
        train_step(
            model,
            optimizer,
            rows,
            algo=AlgoConfig(),
            sampling=SamplingParams(),
            micro_batch_tokens=16384,
            logits_chunk_tokens=args.logits_chunk_tokens,
            grad_clip=1.0,
            current_version=0,
        )
        optimizer.zero_grad(set_to_none=True)
        a = time.perf_counter() - start
        if step == 0:
            trainer_hwm = rss_mb()  # before the bare loop ran
        else:
            steady_hwm = max(steady_hwm, rss_mb())
        start = time.perf_counter()
        _bare_step(model, optimizer, rows)
        b = time.perf_counter() - start
        print(f"  {args.size} train round {step}: asyncrl {a:.3f}s  bare {b:.3f}s", file=sys.stderr)
        if step:
            asyncrl_t.append(a)
            bare_t.append(b)
    a, b = median(asyncrl_t), median(bare_t)
    pgo_mb = n_params * 4 * 4 / MB  # fp32 parameters, gradients, AdamW exp_avg and exp_avg_sq
    return {
        "params": n_params,
        "tokens": tokens,
        "tokens_s": round(tokens / a, 1),
        "bare_tokens_s": round(tokens / b, 1),
        "ratio": round(b / a, 3),
        "mfu": round(6 * n_params * tokens / a / flops, 4),
        "bare_mfu": round(6 * n_params * tokens / b / flops, 4),
        "trainer_rss_mb": round(trainer_hwm - base, 1),
        "params_grads_adam_mb": round(pgo_mb, 1),
        "rss_over_pgo": round((trainer_hwm - base) / pgo_mb, 3),
        "steady_rss_mb": round(steady_hwm - base, 1),
        "steady_rss_over_pgo": round((steady_hwm - base) / pgo_mb, 3),
        "base_mb": round(base, 1),
    }


# ---------------------------------------------------------------------------------------------
# queue


def _codec_s(group: Any, n: int) -> float:
    from asyncrl.protocol import decode_group, encode_group

    start = time.perf_counter()
    for _ in range(n):
        decode_group(encode_group(group))
    return time.perf_counter() - start


def part_queue(args: argparse.Namespace) -> list[dict[str, Any]]:
    import redis
    from bench_codec import make_group  # siblings: the script's folder is importable
    from bench_queue import asyncrl_round, raw_round

    from asyncrl.launch.redis_server import RedisServer
    from asyncrl.protocol import stream_fields

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(data_dir=Path(tmp), appendonly=False).start()
        try:
            client = redis.Redis.from_url(server.url, socket_timeout=30)
            for n_tokens in (int(x) for x in args.queue_tokens.split(",")):
                group = make_group(8, n_tokens)
                fields = stream_fields(group)
                size = sum(len(v) for v in fields.values())
                n = max(8, 2**17 // n_tokens)
                times: dict[str, list[float]] = {"asyncrl": [], "raw": [], "codec": []}
                for r in range(args.rounds + 1):
                    stream = f"bench:{n_tokens}:{r}"
                    start = time.perf_counter()
                    asyncrl_round(client, f"{stream}:asyncrl", fields, n, 16, group)
                    a = time.perf_counter() - start
                    start = time.perf_counter()
                    raw_round(client, f"{stream}:raw", fields, n, 16)
                    b = time.perf_counter() - start
                    c = _codec_s(group, n)
                    if r:
                        times["asyncrl"].append(a)
                        times["raw"].append(b)
                        times["codec"].append(c)
                    for name in ("asyncrl", "raw"):
                        client.delete(f"{stream}:{name}", f"{stream}:{name}:counters")
                a, b, c = (median(times[k]) for k in ("asyncrl", "raw", "codec"))
                row = {
                    "tokens": n_tokens,
                    "message_mb": round(size / MB, 3),
                    "groups": n,
                    "mb_s": round(n * size / MB / a, 1),
                    "raw_mb_s": round(n * size / MB / b, 1),
                    "ratio": round(b / a, 3),
                    "codec_share": round(c / a, 3),
                }
                print(f"  queue {row}", file=sys.stderr)
                out.append(row)
            client.close()
        finally:
            server.stop()
    return out


# ---------------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    match args.child:
        case "broadcast" | "store":
            result: Any = part_sync(args, args.child)
        case "checkpoint":
            result = part_checkpoint(args)
        case "train":
            result = part_train(args)
        case "queue":
            result = part_queue(args)
        case "delta":
            from bench_delta import part_delta

            result = part_delta(args)
        case "flops":
            result = peak_flops()
        case _:
            raise SystemExit(f"unknown part {args.child!r}")
    print(json.dumps(result))


def run_child(args: argparse.Namespace, part: str, size: str, flops: float) -> Any:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", part, "--size", size]
    cmd += ["--rounds", str(args.rounds), "--engine-dtype", args.engine_dtype]
    cmd += ["--copy", args.copy]
    cmd += ["--bucket-mb", str(args.bucket_mb), "--train-tokens", str(args.train_tokens)]
    cmd += ["--logits-chunk-tokens", str(args.logits_chunk_tokens)]
    cmd += ["--queue-tokens", args.queue_tokens, "--peak-flops", str(flops)]
    cmd += ["--lrs", ",".join(map(str, args.lrs))]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def table(result: dict[str, Any]) -> str:
    lines = []
    for size, parts in result["sizes"].items():
        for part, r in parts.items():
            figures = "  ".join(f"{k}={v}" for k, v in r.items())
            lines.append(f"{size:>5} {part:<10} {figures}")
    for part in ("queue", "delta"):
        for r in result.get(part, []):
            lines.append(f"{part} " + "  ".join(f"{k}={v}" for k, v in r.items()))
    return "\n".join(lines)


def merged(lines: list[str]) -> dict[str, Any]:
    """One result of several runs' JSON lines; a later run's figures win."""
    result: dict[str, Any] = {"sizes": {}}
    for line in lines:
        run = json.loads(line)
        for size, parts in run.get("sizes", {}).items():
            result["sizes"].setdefault(size, {}).update(parts)
        for key, value in run.items():
            if key != "sizes":
                result[key] = value
    return result


def plot(result: dict[str, Any], prefix: str) -> None:
    """Log-log figures of the ladder, if matplotlib is installed (it is optional)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return
    sizes = result["sizes"]
    n_params = {
        s: r["params"] for s, parts in sizes.items() for r in parts.values() if "params" in r
    }
    charts = {
        "sync": [("broadcast", "mb_s", "raw_mb_s"), ("store", "mb_s", "raw_mb_s")],
        "train": [("train", "tokens_s", "bare_tokens_s")],
    }
    for name, series in charts.items():
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for part, ours, raw in series:
            xs = [n_params[s] for s in sizes if part in sizes[s]]
            if not xs:
                continue
            ax.plot(xs, [sizes[s][part][ours] for s in sizes if part in sizes[s]], "o-", label=part)
            ax.plot(
                xs,
                [sizes[s][part][raw] for s in sizes if part in sizes[s]],
                "x--",
                label=f"raw {part}",
            )
        ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel=series[0][1])
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{prefix}_{name}.png", dpi=110)
        plt.close(fig)
    if result.get("queue"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        q = result["queue"]
        ax.plot([r["tokens"] for r in q], [r["mb_s"] for r in q], "o-", label="asyncrl")
        ax.plot([r["tokens"] for r in q], [r["raw_mb_s"] for r in q], "x--", label="raw redis-py")
        ax.set(xscale="log", yscale="log", xlabel="response tokens", ylabel="MB/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(f"{prefix}_queue.png", dpi=110)
        plt.close(fig)


def main() -> None:
    from asyncrl.trainer.config import TrainerConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1m,10m,50m,150m", help=f"of {','.join(SIZES)}")
    parser.add_argument("--parts", default=",".join((*PARTS, "queue")))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up")
    parser.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--copy", default="deferred", choices=["deferred", "inline"])
    parser.add_argument("--train-tokens", type=int, default=512, help="tokens per train step")
    parser.add_argument(
        "--logits-chunk-tokens",
        type=int,
        default=TrainerConfig().logits_chunk_tokens,
        help="train_step's head chunk (0: whole logits)",
    )
    parser.add_argument("--queue-tokens", default="256,1024,4096,16384")
    parser.add_argument(
        "--lrs",
        default=[1e-6, 1e-5, 1e-4],
        type=lambda s: [float(x) for x in s.split(",")],
        help="learning rates of the delta part",
    )
    parser.add_argument("--plot", help="save log-log pngs as PREFIX_{sync,train,queue}.png")
    parser.add_argument(
        "--replot", nargs="+", metavar="OUT", help="merge earlier runs' outputs (their last line)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="1m", help=argparse.SUPPRESS)
    parser.add_argument("--peak-flops", type=float, default=1.0, help=argparse.SUPPRESS)
    parser.add_argument("--receiver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--transport", help=argparse.SUPPRESS)
    parser.add_argument("--redis", help=argparse.SUPPRESS)
    parser.add_argument("--worker", default="w0", help=argparse.SUPPRESS)
    parser.add_argument("--run", default=RUN, help=argparse.SUPPRESS)
    parser.add_argument("--store-dir", help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        return receiver(args)
    if args.child:
        return child(args)
    if args.replot:
        result = merged([Path(f).read_text().strip().splitlines()[-1] for f in args.replot])
        if args.plot:
            plot(result, args.plot)
        print(table(result))
        print(json.dumps(result))
        return
    parts = args.parts.split(",")
    sizes = args.sizes.split(",")
    unknown = sorted(set(sizes) - set(SIZES)) + sorted(set(parts) - {*PARTS, "queue", "delta"})
    if unknown:
        raise SystemExit(f"unknown size or part: {', '.join(unknown)}")
    flops = run_child(args, "flops", "1m", 1.0) if "train" in parts else 1.0
    result: dict[str, Any] = {"peak_flops": round(flops), "engine_dtype": args.engine_dtype}
    result["sizes"] = {}
    for size in sizes if any(p in parts for p in PARTS) else []:
        result["sizes"][size] = {}
        for part in (p for p in PARTS if p in parts):
            print(f"{size} {part} ...", file=sys.stderr)
            result["sizes"][size][part] = run_child(args, part, size, flops)
    if "queue" in parts:
        result["queue"] = run_child(args, "queue", "1m", flops)
    if "delta" in parts:
        result["delta"] = [row for size in sizes for row in run_child(args, "delta", size, flops)]
    if args.plot:
        plot(result, args.plot)
    print(table(result))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
