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

With `rollout.capture_routing` (an MoE model) requests add `"return_routed_experts": true` and
replies carry `meta_info.routed_experts`: base64 of little-endian int32 expert ids, flat over
[prompt + completion tokens − 1, MoE layers, top-k] (SGLang's `--enable-return-routed-experts`,
`state_capturer/routed_experts.py`); the layers and top-k come from the model's config. A reply
without them, or of another size or with ids outside the experts, is malformed.

Per-token versions come from `weight_versions` (spans over the response tokens) where the server
reports them (SGLang main since mid-2026 and `asyncrl serve`); a server that reports only
`weight_version` (SGLang 0.5.x) has it assigned to every token of the request. That value is
the version at the end of the request, so tokens drawn before an in-flight update are stamped
newer than they are: use `weights.pause_mode: retract` with such servers, which recomputes retracted
requests under the new weights. Version names are integers as strings; SGLang's initial name
"default" reads as 0.

With `model.lora` (`lora=True`) the servers serve the trained adapter (`asyncrl.sglang.publisher`
loads version v as `asyncrl-v{v}` and then names the server's weights v): a request names, in
`lora_path`, the adapter of the version its server holds, and every token of it is stamped with
that version — a request keeps its adapter to the end, whatever is loaded meanwhile, so these
versions are exact. Version 0 is the base model (a fresh adapter adds nothing): no adapter.

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

import base64
import binascii
import logging
import random
import subprocess
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.engines.base import EngineError, Generation
from asyncrl.engines.routing import MoeShape, moe_shape_of_config
from asyncrl.sglang.client import (
    RequestFailure,
    Server,
    ServerPool,
    http_info,
    http_json,
    launch_servers,
    malformed,
    parse_version,
    stop_servers,
)

if TYPE_CHECKING:
    from asyncrl.engines.config import SamplingParams
    from asyncrl.model_config import LoraConfig
    from asyncrl.sglang.config import SglangEngineConfig

log = logging.getLogger(__name__)

_VERSION_TTL_S = 0.2  # a server's weight version is asked at most this often


def adapter_name(version: int) -> str:
    """The name a LoRA server holds adapter version `version` under."""
    return f"asyncrl-v{version}"


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
            raise malformed("reply has neither weight_versions nor weight_version")
        return np.full(n, parse_version(meta["weight_version"]), dtype=np.int32)
    versions = np.empty(n, dtype=np.int32)
    end = 0
    try:
        for span in spans:
            start, stop = int(span["start"]), int(span["end"])
            if start != end or stop < start:
                raise malformed(f"weight_versions spans are not contiguous: {spans}")
            versions[start:stop] = parse_version(span["version"])
            end = stop
    except (TypeError, KeyError, ValueError):
        raise malformed(f"weight_versions is not a list of spans: {spans!r:.200}") from None
    if end != n:
        raise malformed(f"weight_versions cover {end} tokens of {n}")
    if (np.diff(versions) < 0).any():
        raise malformed(f"weight_versions go backwards: {spans}")
    return versions


def parse_routed_experts(meta: Mapping[str, Any], moe: MoeShape, rows: int) -> np.ndarray:
    """`meta_info.routed_experts` as uint16 [rows, layers, top-k]; RequestFailure (malformed)
    unless it is base64 of exactly that many int32 ids, each an expert of the model."""
    text = meta.get("routed_experts")
    if not isinstance(text, str):
        raise malformed(
            "reply has no routed_experts (start the server with --enable-return-routed-experts)"
        )
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise malformed("routed_experts is not base64") from None
    per_token = moe.layers * moe.top_k
    if len(raw) != 4 * rows * per_token:
        raise malformed(
            f"routed_experts holds {len(raw)} bytes, expected {rows} tokens x {moe.layers} "
            f"layers x top-{moe.top_k} int32"
        )
    ids = np.frombuffer(raw, dtype="<i4")
    if ids.size and (ids.min() < 0 or ids.max() >= moe.num_experts):
        raise malformed(f"routed_experts has ids outside [0, {moe.num_experts})")
    return ids.astype(np.uint16).reshape(rows, moe.layers, moe.top_k)


def parse_generation(
    item: Any, greedy: bool, routing: tuple[MoeShape, int] | None = None
) -> Generation:
    """One reply item → Generation; RequestFailure if it is malformed or was aborted. With
    `routing` (the model's MoE shape, the prompt's length) its routed experts too."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise malformed(f"reply item has no meta_info: {item!r:.200}")
    meta = item["meta_info"]
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        raise RequestFailure(
            "aborted", f"server aborted the request: {finish}", server_fault=False, retry=True
        )
    if kind not in ("stop", "length"):
        raise malformed(f"finish_reason {finish!r} is not stop, length or abort")
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list) or not triples:
        raise malformed("reply has no output_token_logprobs")
    try:
        logprobs = np.array([float(t[0]) for t in triples], dtype=np.float64)
        tokens = np.array([int(t[1]) for t in triples], dtype=np.int32)
    except (TypeError, ValueError, IndexError):
        raise malformed(
            f"output_token_logprobs are not [logprob, id, text] triples: {triples[:3]!r}"
        ) from None
    n = len(tokens)
    output_ids = item.get("output_ids")
    if output_ids is not None and list(output_ids) != tokens.tolist():
        raise malformed(f"{n} log-probs for {len(output_ids)} output ids, or other ids")
    completion = meta.get("completion_tokens")
    if completion is not None and completion != n:
        raise malformed(f"{n} log-probs for {completion} completion tokens")
    if not np.isfinite(logprobs).all():
        raise malformed("non-finite log-prob")
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
        routed_experts=(
            None if routing is None else parse_routed_experts(meta, routing[0], routing[1] + n - 1)
        ),
    )


class SglangEngine:
    """`RolloutEngine` over SGLang servers. Thread-safe; prompts are sent in chunks of
    `chunk_size`, spread over the live servers by a pool of `max_concurrency` threads."""

    def __init__(
        self,
        cfg: SglangEngineConfig,
        urls: list[str],
        procs: list[subprocess.Popen[bytes]],
        moe: MoeShape | None = None,
        *,
        lora: bool = False,
    ) -> None:
        self.cfg = cfg
        self.moe = moe
        """Set: ask for each token's routed experts, of this shape."""
        self.urls = [u.rstrip("/") for u in urls]
        self.pool = ServerPool(self.urls, cfg.health_interval_s, cfg.health_timeout_s)
        self._procs = procs
        self._lora = lora
        self._executor = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="sglang")
        self._version = 0
        self._server_versions: dict[str, tuple[float, int]] = {}  # url → (asked at, version)

    @classmethod
    def from_config(
        cls,
        cfg: SglangEngineConfig,
        *,
        model_path: str,
        lora: LoraConfig | None = None,
        capture_routing: bool = False,
    ) -> SglangEngine:
        moe = None
        if capture_routing:
            from transformers import AutoConfig

            moe = moe_shape_of_config(AutoConfig.from_pretrained(model_path))
            if moe is None:
                raise ValueError(
                    "rollout.capture_routing needs a mixture-of-experts model (Qwen3-MoE, "
                    f"Qwen2-MoE, Mixtral) at {model_path}"
                )
            args = {**cfg.server_args, "enable_return_routed_experts": True}
            cfg = cfg.model_copy(update={"server_args": args})
        if cfg.launch:
            procs = launch_servers(cfg, model_path, lora)
            urls = [f"http://{cfg.host}:{cfg.port + i}" for i in range(cfg.servers)]
            return cls(cfg, urls, procs, moe, lora=lora is not None)
        assert cfg.urls is not None  # the config's validator guarantees one or the other
        return cls(cfg, cfg.urls, [], moe, lora=lora is not None)

    @property
    def version(self) -> int:
        """The version every live server holds (the smallest); the last known one when no
        server answers."""
        seen = []
        for url in self.pool.alive():
            try:
                seen.append(self._server_version(url))
            except RequestFailure:
                continue
        if seen:
            self._version = min(seen)
        return self._version

    def _server_version(self, url: str) -> int:
        """The weight version of the server at `url`, asked at most every 0.2 s."""
        now = time.monotonic()
        asked = self._server_versions.get(url)
        if asked is not None and now - asked[0] < _VERSION_TTL_S:
            return asked[1]
        info = http_info(url, "model_info", timeout_s=self.cfg.health_timeout_s)
        try:
            version = parse_version(info["weight_version"])
        except (TypeError, KeyError):
            raise malformed(f"{url}/model_info has no weight_version") from None
        self._server_versions[url] = (now, version)
        return version

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
            **({"return_routed_experts": True} if self.moe is not None else {}),
        }
        failure: RequestFailure | None = None
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                wait = min(self.cfg.backoff_s * 2 ** (attempt - 1), self.cfg.backoff_max_s)
                time.sleep(wait * random.uniform(0.5, 1.0))
            server: Server | None = None
            try:
                server = self.pool.acquire()
                adapter = self._adapter(server.url, body)
                reply = http_json(server.url, "/generate", body, timeout_s=self.cfg.timeout_s)
                if not isinstance(reply, list) or len(reply) != len(prompts):
                    raise malformed(
                        f"{type(reply).__name__} reply for a batch of {len(prompts)} prompts"
                    )
                gens = [
                    parse_generation(item, greedy, None if self.moe is None else (self.moe, len(p)))
                    for item, p in zip(reply, prompts, strict=True)
                ]
                if adapter is not None:
                    for gen in gens:
                        gen.versions[:] = adapter
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

    def _adapter(self, url: str, body: dict[str, Any]) -> int | None:
        """With LoRA: name in `body` the adapter of the version the server at `url` holds, and
        return that version (None without LoRA)."""
        if not self._lora:
            return None
        version = self._server_version(url)
        body["lora_path"] = adapter_name(version) if version > 0 else None
        return version

    def close(self) -> None:
        """Stop the request threads and the servers this engine launched."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        stop_servers(self._procs)
