"""The SGLang engine: a `RolloutEngine` over the HTTP API of one or more SGLang servers.

Nothing of SGLang is imported: the servers may run from their own environment, and the client is
plain HTTP plus JSON. The request and reply shapes follow SGLang's native API of the 0.5 series
(`python/sglang/srt/entrypoints/http_server.py`, `managers/io_struct.py`), checked against its
source, not against a running server:

    POST /generate  {"input_ids": [[...], ...], "sampling_params": {...}, "return_logprob": true}
    → [{"output_ids": [...], "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort"},
        "completion_tokens": n, "output_token_logprobs": [[logprob, token_id, text], ...],
        "weight_version": "7", "weight_versions": [{"version": "6", "start": 0, "end": 3},
                                                   {"version": "7", "start": 3, "end": n}]}}]

Per-token versions come from `weight_versions` (spans over the response tokens) where the server
reports them (SGLang main since mid-2026 and `asyncrl serve`); a server that reports only
`weight_version` (SGLang 0.5.x) has it assigned to every token of the request. That value is
the version at the end of the request, so tokens drawn before an in-flight update are stamped
newer than they are: use `pause_mode: retract` with such servers, which recomputes retracted
requests under the new weights. Version names are integers as strings; SGLang's initial name
"default" reads as 0.

Behaviour log-probs: SGLang returns log-softmax of the temperature-scaled logits (unless the
server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1), before top-k / top-p. That is
`sampling_logprobs` exactly when top_p = 1 and top_k = 0, so truncated sampling is refused here.
Stop tokens: SGLang stops on `stop_token_ids` and on the model's EOS; an explicit list therefore
adds to EOS instead of replacing it as in the torch engine.

Failures: a request that times out, cannot connect, gets HTTP 5xx, or a reply that is not JSON,
lacks a field, or whose log-prob list does not match its tokens, is retried with exponential
backoff (on another server when there is one) and the server is taken out of rotation until its
/health answers 200 again. HTTP 4xx is the request's own fault and is not retried (a chunk is
split so that only the offending prompts fail). What still fails raises `EngineError` with a
short `reason`, which the worker turns into dead-lettered prompts; it never ends the process.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import numpy as np

from asyncrl.device import sglang_device_args, visible_devices_env
from asyncrl.rollout.config import SamplingParams, SglangEngineConfig
from asyncrl.rollout.engine import Generation

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """Generation failed for some prompts after retries; the caller dead-letters them.

    `reason` is a short stable code: `timeout`, `unreachable`, `server_error` (HTTP 5xx),
    `malformed` (bad reply), `rejected` (HTTP 4xx), `aborted` (the server aborted the request,
    e.g. paused with mode abort) or `no_server` (none in rotation).
    """

    def __init__(
        self,
        reason: str,
        detail: str,
        generations: list[Generation | None] | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.generations: list[Generation | None] = generations or []
        """One entry per prompt of the failed `generate` call: the result, or None where the
        prompt failed (`failed` lists those)."""

    @property
    def failed(self) -> list[int]:
        """Indices of the prompts that got no generation."""
        return [i for i, g in enumerate(self.generations) if g is None]


class RequestFailure(Exception):
    """One failed HTTP exchange. `server_fault`: the server, not the request, is to blame (it
    leaves the rotation); `retry`: another attempt may succeed."""

    def __init__(
        self,
        reason: str,
        detail: str,
        *,
        server_fault: bool,
        retry: bool,
        status: int | None = None,
    ) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail
        self.server_fault, self.retry = server_fault, retry
        self.status = status
        """HTTP status of a reply that came with an error status."""


def _malformed(detail: str) -> RequestFailure:
    return RequestFailure("malformed", detail, server_fault=True, retry=True)


def http_json(url: str, path: str, body: Any = None, *, timeout_s: float) -> Any:
    """One request to `url + path` (POST with a JSON body when `body` is given, else GET);
    the decoded JSON reply, None for an empty one. Raises RequestFailure."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port
    conn_cls = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    conn = conn_cls(host, port, timeout=timeout_s)
    data = None if body is None else json.dumps(body).encode()
    try:
        conn.request(
            "GET" if body is None else "POST",
            parts.path.rstrip("/") + path,
            body=data,
            headers={"Content-Type": "application/json"} if data is not None else {},
        )
        reply = conn.getresponse()
        payload = reply.read()
    except TimeoutError as exc:
        raise RequestFailure(
            "timeout", f"{url}{path}: {exc}", server_fault=True, retry=True
        ) from None
    except (OSError, http.client.HTTPException) as exc:
        raise RequestFailure(
            "unreachable",
            f"{url}{path}: {type(exc).__name__}: {exc}",
            server_fault=True,
            retry=True,
        ) from None
    finally:
        conn.close()
    if reply.status >= 500:
        raise RequestFailure(
            "server_error",
            f"{url}{path}: HTTP {reply.status}",
            server_fault=True,
            retry=True,
            status=reply.status,
        )
    if reply.status >= 400:
        raise RequestFailure(
            "rejected",
            f"{url}{path}: HTTP {reply.status}: {payload[:300].decode(errors='replace')}",
            server_fault=False,
            retry=False,
            status=reply.status,
        )
    if not payload.strip():
        return None
    try:
        return json.loads(payload)
    except ValueError:
        raise _malformed(f"{url}{path}: reply is not JSON: {payload[:100]!r}") from None


def parse_version(value: Any) -> int:
    """A weight version name as asyncrl uses it: an integer; SGLang's initial "default" is 0."""
    if value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise _malformed(f"weight version {value!r} is not an integer") from None


@dataclass
class _Server:
    url: str
    alive: bool = True
    inflight: int = 0
    next_probe: float = 0.0
    probing: bool = False


@dataclass
class ServerPool:
    """The servers in rotation. A request goes to the live server with the fewest requests in
    flight; a server that failed leaves the rotation and rejoins once /health answers 200.
    Dead servers are probed lazily by the threads that ask for a server (at most once per
    `health_interval_s` each, and at once when none is alive), so nothing runs in the
    background."""

    urls: list[str]
    health_interval_s: float
    health_timeout_s: float
    _servers: list[_Server] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("no SGLang server URLs")
        self._servers = [_Server(url.rstrip("/")) for url in self.urls]

    def alive(self) -> list[str]:
        with self._lock:
            return [s.url for s in self._servers if s.alive]

    def acquire(self) -> _Server:
        self._probe_dead()
        with self._lock:
            alive = [s for s in self._servers if s.alive]
            if not alive:
                raise RequestFailure(
                    "no_server", "no SGLang server is in rotation", server_fault=False, retry=True
                )
            server = min(alive, key=lambda s: s.inflight)
            server.inflight += 1
            return server

    def release(self, server: _Server, *, failed: RequestFailure | None = None) -> None:
        with self._lock:
            server.inflight -= 1
            if failed is not None and failed.server_fault and server.alive:
                server.alive = False
                server.next_probe = time.monotonic() + self.health_interval_s
                log.warning("SGLang server %s out of rotation: %s", server.url, failed)

    def _probe_dead(self) -> None:
        now = time.monotonic()
        with self._lock:
            none_alive = not any(s.alive for s in self._servers)
            due = [
                s
                for s in self._servers
                if not s.alive and not s.probing and (none_alive or s.next_probe <= now)
            ]
            for s in due:
                s.probing = True
        for server in due:
            try:
                http_json(server.url, "/health", timeout_s=self.health_timeout_s)
                healthy = True
            except RequestFailure:
                healthy = False
            with self._lock:
                server.probing = False
                server.alive = healthy
                server.next_probe = time.monotonic() + self.health_interval_s
            if healthy:
                log.info("SGLang server %s back in rotation", server.url)


def sglang_sampling(params: SamplingParams) -> dict[str, Any]:
    """SGLang's `sampling_params` for ours; ValueError for what SGLang cannot record exactly."""
    if params.top_p < 1.0 or params.top_k > 0:
        raise ValueError(
            "the SGLang engine needs rollout.sampling.top_p=1 and top_k=0: SGLang's returned "
            "log-probs are not renormalised after top-p / top-k truncation"
        )
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "max_new_tokens": params.max_new_tokens,
        # Ids, not text: stop tokens stay in the output, nothing is trimmed or detokenised away.
        "no_stop_trim": True,
        "skip_special_tokens": False,
    }
    if params.stop_token_ids is not None:
        out["stop_token_ids"] = list(params.stop_token_ids)
    return out


def _versions(meta: Mapping[str, Any], n: int) -> np.ndarray:
    spans = meta.get("weight_versions")
    if spans is None:
        if "weight_version" not in meta:
            raise _malformed("reply has neither weight_versions nor weight_version")
        return np.full(n, parse_version(meta["weight_version"]), dtype=np.int32)
    versions = np.empty(n, dtype=np.int32)
    end = 0
    try:
        for span in spans:
            start, stop = int(span["start"]), int(span["end"])
            if start != end or stop < start:
                raise _malformed(f"weight_versions spans are not contiguous: {spans}")
            versions[start:stop] = parse_version(span["version"])
            end = stop
    except (TypeError, KeyError, ValueError):
        raise _malformed(f"weight_versions is not a list of spans: {spans!r:.200}") from None
    if end != n:
        raise _malformed(f"weight_versions cover {end} tokens of {n}")
    if (np.diff(versions) < 0).any():
        raise _malformed(f"weight_versions go backwards: {spans}")
    return versions


def parse_generation(item: Any, greedy: bool) -> Generation:
    """One reply item → Generation; RequestFailure if it is malformed or was aborted."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise _malformed(f"reply item has no meta_info: {item!r:.200}")
    meta = item["meta_info"]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        raise RequestFailure(
            "aborted", f"server aborted the request: {finish}", server_fault=False, retry=True
        )
    if kind not in ("stop", "length"):
        raise _malformed(f"finish_reason {finish!r} is not stop, length or abort")
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list) or not triples:
        raise _malformed("reply has no output_token_logprobs")
    try:
        logprobs = np.array([float(t[0]) for t in triples], dtype=np.float64)
        tokens = np.array([int(t[1]) for t in triples], dtype=np.int32)
    except (TypeError, ValueError, IndexError):
        raise _malformed(
            f"output_token_logprobs are not [logprob, id, text] triples: {triples[:3]!r}"
        ) from None
    n = len(tokens)
    output_ids = item.get("output_ids")
    if output_ids is not None and list(output_ids) != tokens.tolist():
        raise _malformed(f"{n} log-probs for {len(output_ids)} output ids, or other ids")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != n:
        raise _malformed(f"{n} log-probs for {completion} completion tokens")
    if not np.isfinite(logprobs).all():
        raise _malformed("non-finite log-prob")
    # Greedy draws are certain: log-prob 0, as `sampling_logprobs` records them (SGLang returns
    # the untempered distribution's value). Rounding can leave a sampled one a hair above 0.
    recorded = np.zeros(n) if greedy else np.minimum(logprobs, 0.0)
    cached = meta.get("cached_tokens")  # RadixAttention's prefix hits; absent on old servers
    return Generation(
        token_ids=tokens,
        logprobs=recorded.astype(np.float32),
        versions=_versions(meta, n),
        finish=kind,
        cached_tokens=cached if isinstance(cached, int) and cached > 0 else 0,
    )


def _flags(args: Mapping[str, str | int | float | bool]) -> list[str]:
    out: list[str] = []
    for name, value in args.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False:
            out += [flag, str(value)]
    return out


def launch_servers(cfg: SglangEngineConfig, model_path: str) -> list[subprocess.Popen[bytes]]:
    """Start `cfg.servers` SGLang servers and wait until each answers /health. Each gets its
    own session (SGLang forks scheduler and detokenizer processes) so that `stop_servers` ends
    the whole tree through the handle."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(cfg.servers):
            cmd = [
                cfg.python, "-m", "sglang.launch_server",
                "--model-path", model_path,
                "--host", cfg.host,
                "--port", str(cfg.port + i),
                "--weight-version", "0",
                *sglang_device_args(cfg.device),
                *_flags(cfg.server_args),
            ]  # fmt: skip
            devices = range(i * cfg.devices_per_server, (i + 1) * cfg.devices_per_server)
            env = {**os.environ, **visible_devices_env(cfg.device, list(devices))}
            # Log-probs must be of the tempered distribution, the one sampled from.
            env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
            log.info("starting SGLang server %d: %s", i, " ".join(cmd))
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        deadline = time.monotonic() + cfg.startup_timeout_s
        for i, proc in enumerate(procs):
            url = f"http://{cfg.host}:{cfg.port + i}"
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"SGLang server {url} exited with code {proc.returncode}")
                try:
                    http_json(url, "/health", timeout_s=cfg.health_timeout_s)
                    break
                except RequestFailure:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"SGLang server {url} not healthy after {cfg.startup_timeout_s:.0f}s"
                        ) from None
                    time.sleep(1.0)
    except BaseException:
        stop_servers(procs)
        raise
    return procs


def stop_servers(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class SglangEngine:
    """`RolloutEngine` over SGLang servers. Thread-safe; prompts are sent in chunks of
    `chunk_size`, spread over the live servers by a pool of `max_concurrency` threads."""

    def __init__(
        self, cfg: SglangEngineConfig, urls: list[str], procs: list[subprocess.Popen[bytes]]
    ) -> None:
        self.cfg = cfg
        self.urls = [u.rstrip("/") for u in urls]
        self.pool = ServerPool(self.urls, cfg.health_interval_s, cfg.health_timeout_s)
        self._procs = procs
        self._executor = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="sglang")
        self._version = 0
        self._version_checked = 0.0

    @classmethod
    def from_config(cls, cfg: SglangEngineConfig, *, model_path: str) -> SglangEngine:
        if cfg.launch:
            procs = launch_servers(cfg, model_path)
            urls = [f"http://{cfg.host}:{cfg.port + i}" for i in range(cfg.servers)]
            return cls(cfg, urls, procs)
        assert cfg.urls is not None  # the config's validator guarantees one or the other
        return cls(cfg, cfg.urls, [])

    @property
    def version(self) -> int:
        """The version every live server holds (the smallest), asked at most every 0.2 s; the
        last known one when no server answers."""
        now = time.monotonic()
        if now - self._version_checked >= 0.2:
            self._version_checked = now
            seen = []
            for url in self.pool.alive():
                try:
                    info = http_json(url, "/get_model_info", timeout_s=self.cfg.health_timeout_s)
                    seen.append(parse_version(info["weight_version"]))
                except (RequestFailure, TypeError, KeyError):
                    continue
            if seen:
                self._version = min(seen)
        return self._version

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError(
            "SGLang servers take weights from the trainer's SGLang publisher "
            "(asyncrl.weights.sglang), not through the rollout worker"
        )

    def state_dict_for_sync(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError("SGLang servers hold their weights; see stage_weights")

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        sampling = sglang_sampling(params)
        greedy = params.temperature == 0.0
        size = self.cfg.chunk_size
        chunks = [list(range(s, min(s + size, len(prompts)))) for s in range(0, len(prompts), size)]
        futures = [
            self._executor.submit(self._run_chunk, [prompts[i] for i in c], sampling, greedy)
            for c in chunks
        ]
        results: list[Generation | None] = [None] * len(prompts)
        errors: list[EngineError] = []
        for chunk, future in zip(chunks, futures, strict=True):
            for i, outcome in zip(chunk, future.result(), strict=True):
                if isinstance(outcome, EngineError):
                    errors.append(outcome)
                else:
                    results[i] = outcome
        if errors:
            first = errors[0]
            raise EngineError(
                first.reason,
                f"{len(errors)} of {len(prompts)} prompts failed; first: {first.detail}",
                results,
            )
        return [g for g in results if g is not None]

    def _run_chunk(
        self, prompts: list[list[int]], sampling: dict[str, Any], greedy: bool
    ) -> list[Generation | EngineError]:
        try:
            return list(self._request(prompts, sampling, greedy))
        except EngineError as exc:
            if exc.reason != "rejected" or len(prompts) == 1:
                return [exc] * len(prompts)
        # A 4xx names no prompt: alone, each one finds out whether it is the culprit.
        return [out for p in prompts for out in self._run_chunk([p], sampling, greedy)]

    def _request(
        self, prompts: list[list[int]], sampling: dict[str, Any], greedy: bool
    ) -> list[Generation]:
        body = {
            "input_ids": prompts,
            "sampling_params": sampling,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }
        failure: RequestFailure | None = None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                wait = min(self.cfg.backoff_s * 2 ** (attempt - 1), self.cfg.backoff_max_s)
                time.sleep(wait * random.uniform(0.5, 1.0))
            server: _Server | None = None
            try:
                server = self.pool.acquire()
                reply = http_json(server.url, "/generate", body, timeout_s=self.cfg.timeout_s)
                if not isinstance(reply, list) or len(reply) != len(prompts):
                    raise _malformed(
                        f"{type(reply).__name__} reply for a batch of {len(prompts)} prompts"
                    )
                gens = [parse_generation(item, greedy) for item in reply]
            except RequestFailure as exc:
                failure = exc
                log.warning("SGLang request (attempt %d) failed: %s", attempt + 1, exc)
                if server is not None:
                    self.pool.release(server, failed=exc)
                if not exc.retry:
                    break
                continue
            self.pool.release(server)
            return gens
        assert failure is not None
        attempts = "1 attempt" if not failure.retry else f"{self.cfg.retries + 1} attempts"
        raise EngineError(failure.reason, f"{failure.detail} ({attempts})")

    def close(self) -> None:
        """Stop the request threads and the servers this engine launched."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        stop_servers(self._procs)
