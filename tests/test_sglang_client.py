"""The SGLang engine client against tiny fake servers (loopback, in this process) that answer
well or badly on cue: parsing, retries with backoff, EngineError reasons, server rotation."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest

from asyncrl.engines.base import EngineError
from asyncrl.engines.config import SamplingParams
from asyncrl.rollout.backends import build_engine
from asyncrl.sglang.client import http_info, http_json
from asyncrl.sglang.config import SglangEngineConfig
from asyncrl.sglang.engine import SglangEngine

EOS = 2
PARAMS = SamplingParams(max_new_tokens=3)


def _item(prompt: list[int], how: str) -> dict[str, Any]:
    tokens = [prompt[-1] + 1, prompt[-1] + 2, EOS]
    triples = [[-0.5, t, None] for t in tokens]
    meta: dict[str, Any] = {
        "id": "x",
        "finish_reason": {"type": "stop", "matched": EOS},
        "prompt_tokens": len(prompt),
        "cached_tokens": len(prompt) - 1,  # RadixAttention had all but the last token
        "completion_tokens": len(tokens),
        "output_token_logprobs": triples,
        "weight_version": "3",
    }
    if how == "spans":
        meta["weight_versions"] = [
            {"version": "2", "start": 0, "end": 1},
            {"version": "3", "start": 1, "end": 3},
        ]
    elif how == "default":  # an older server: no version, no cache figures
        meta["weight_version"] = "default"
        meta.pop("cached_tokens")
    elif how == "short":
        meta["output_token_logprobs"] = triples[:2]
        meta.pop("completion_tokens")
    elif how == "abort":
        meta["finish_reason"] = {"type": "abort", "message": "paused"}
    elif how == "bad_spans":
        meta["weight_versions"] = [{"version": "3", "start": 0, "end": 2}]
    return {"text": "", "output_ids": tokens, "meta_info": meta}


class FakeServer:
    """Answers /generate as told by `script` (one entry per request, then `ok`)."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.healthy = True
        self.legacy = False  # an older SGLang: no /model_info, /server_info
        self.gets: list[str] = []
        self.generates = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.gets.append(self.path)
                if fake.legacy and self.path in ("/model_info", "/server_info"):
                    self._send(404, b'{"detail": "Not Found"}')
                elif self.path == "/health":
                    self._send(200 if fake.healthy else 503, b"")
                else:
                    self._send(200, json.dumps({"weight_version": "3"}).encode())

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.generates += 1
                    how = fake.script.pop(0) if fake.script else "ok"
                prompts = body["input_ids"]
                if how == "500":
                    self._send(500, b"Internal Server Error")
                elif how == "not_json":
                    self._send(200, b"<html>oops</html>")
                elif how == "no_meta":
                    self._send(200, json.dumps([{"text": "hi"}] * len(prompts)).encode())
                elif how == "reject_99" and any(99 in p for p in prompts):
                    self._send(400, b'{"message": "prompt too long"}')
                else:
                    if how == "slow":
                        time.sleep(0.8)
                    reply = [_item(p, how) for p in prompts]
                    self._send(200, json.dumps(reply).encode())

            def _send(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def servers() -> Iterator[list[FakeServer]]:
    fakes = [FakeServer(), FakeServer()]
    try:
        yield fakes
    finally:
        for fake in fakes:
            fake.stop()


def _engine(urls: list[str], **overrides: Any) -> SglangEngine:
    cfg = SglangEngineConfig(
        urls=urls,
        retries=2,
        backoff_s=0.01,
        timeout_s=0.5,
        health_interval_s=0.2,
        health_timeout_s=0.5,
        chunk_size=2,
        max_concurrency=4,
        **overrides,
    )
    engine = build_engine(cfg, model_path="unused")
    assert isinstance(engine, SglangEngine)
    return engine


@pytest.mark.parametrize(
    ("how", "versions"), [("ok", [3, 3, 3]), ("spans", [2, 3, 3]), ("default", [0, 0, 0])]
)
def test_replies_become_generations(servers: list[FakeServer], how: str, versions: list[int]):
    servers[0].script = [how] * 2
    engine = _engine([servers[0].url])
    gens = engine.generate([[1, 4], [1, 7, 8]], PARAMS)
    assert [g.token_ids.tolist() for g in gens] == [[5, 6, EOS], [9, 10, EOS]]
    for g in gens:
        assert g.token_ids.dtype == np.int32 and g.versions.dtype == np.int32
        assert g.logprobs.dtype == np.float32 and (g.logprobs == -0.5).all()
        assert g.versions.tolist() == versions and g.finish == "stop"
    assert [g.cached_tokens for g in gens] == ([0, 0] if how == "default" else [1, 2])
    assert engine.version == 3  # /model_info
    engine.close()


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("500", "server_error"),
        ("not_json", "malformed"),
        ("no_meta", "malformed"),
        ("short", "malformed"),
        ("bad_spans", "malformed"),
        ("slow", "timeout"),
        ("abort", "aborted"),
    ],
)
def test_bad_replies_are_retried_then_raise(servers: list[FakeServer], how: str, reason: str):
    fake = servers[0]
    fake.script = [how] * 3
    engine = _engine([fake.url])
    with pytest.raises(EngineError) as info:
        engine.generate([[1, 4]], PARAMS)
    assert info.value.reason == reason
    assert info.value.failed == [0] and info.value.generations == [None]
    assert fake.generates == 3  # the first try and two retries
    # The engine is still usable: the server answers well again and is back in rotation.
    assert len(engine.generate([[1, 4]], PARAMS)) == 1
    engine.close()


def test_one_failure_is_absorbed_by_a_retry(servers: list[FakeServer]) -> None:
    servers[0].script = ["500"]
    engine = _engine([servers[0].url])
    assert engine.generate([[1, 4]], PARAMS)[0].token_ids.tolist() == [5, 6, EOS]
    assert servers[0].generates == 2
    engine.close()


def test_rejected_chunk_fails_only_its_culprit(servers: list[FakeServer]) -> None:
    fake = servers[0]
    fake.script = ["reject_99"] * 3
    engine = _engine([fake.url])
    with pytest.raises(EngineError) as info:
        engine.generate([[1, 4], [1, 99]], PARAMS)  # one chunk of two
    assert info.value.reason == "rejected" and info.value.failed == [1]
    first = info.value.generations[0]
    assert first is not None and first.token_ids.tolist() == [5, 6, EOS]
    assert fake.generates == 3  # the chunk, then each prompt alone; a 4xx is not retried
    engine.close()


def test_dead_server_leaves_rotation_and_rejoins(servers: list[FakeServer]) -> None:
    a, b = servers
    engine = _engine([a.url, b.url])
    a.healthy, a.script = False, ["500"]
    engine.generate([[1, 4]], PARAMS)  # a fails once, the retry goes to b
    assert engine.pool.alive() == [b.url]
    before = a.generates
    for _ in range(3):
        engine.generate([[1, 4]], PARAMS)
    time.sleep(0.3)  # a probe comes due, but /health still says 503
    engine.generate([[1, 4]], PARAMS)
    assert a.generates == before and engine.pool.alive() == [b.url]

    a.healthy = True
    time.sleep(0.3)
    engine.generate([[1, 4]] * 8, PARAMS)  # four chunks; the first asks for a probe first
    assert engine.pool.alive() == [a.url, b.url]
    assert a.generates > before
    engine.close()


def test_chunks_spread_over_servers(servers: list[FakeServer]) -> None:
    engine = _engine([s.url for s in servers])
    gens = engine.generate([[1, i] for i in range(3, 19)], PARAMS)  # 8 chunks of 2
    assert [g.token_ids[0] for g in gens] == list(range(4, 20))
    assert servers[0].generates > 0 and servers[1].generates > 0
    assert servers[0].generates + servers[1].generates == 8
    engine.close()


def test_no_server_in_rotation_raises(servers: list[FakeServer]) -> None:
    url = servers[0].url
    servers[0].stop()
    servers[0] = FakeServer()  # the fixture stops this one instead
    engine = _engine([url])
    with pytest.raises(EngineError) as info:
        engine.generate([[1, 4]], PARAMS)
    assert info.value.reason in ("unreachable", "no_server")
    engine.close()


def test_truncated_sampling_is_refused(servers: list[FakeServer]) -> None:
    engine = _engine([servers[0].url])
    with pytest.raises(ValueError, match="top_p=1 and top_k=0"):
        engine.generate([[1]], SamplingParams(top_p=0.9))
    assert servers[0].generates == 0
    engine.close()


def test_config_needs_urls_or_launch() -> None:
    with pytest.raises(ValueError, match="urls is empty"):
        SglangEngineConfig()
    with pytest.raises(ValueError, match="either urls"):
        SglangEngineConfig(urls=["http://127.0.0.1:1"], launch=True)
    assert SglangEngineConfig(launch=True).device == "cuda"


def test_connections_are_kept_alive_and_renewed() -> None:
    opened: list[object] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as SGLang's server

        def setup(self) -> None:
            super().setup()
            opened.append(self.client_address)

        def do_GET(self) -> None:
            data = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            # Closed after the reply without saying so, as an idle timeout closes it.
            self.close_connection = self.path == "/close"

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        for _ in range(3):
            assert http_json(url, "/x", timeout_s=5) == {"ok": True}
        assert len(opened) == 1
        assert http_json(url, "/close", timeout_s=5) == {"ok": True}
        time.sleep(0.2)
        assert http_json(url, "/x", timeout_s=5) == {"ok": True}  # on a new connection
        assert len(opened) == 2
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_info_uses_current_names_with_a_fallback_found_once(servers: list[FakeServer]) -> None:
    current, legacy = servers
    legacy.legacy = True
    for _ in range(3):
        assert http_info(current.url, "model_info", timeout_s=1)["weight_version"] == "3"
        assert http_info(legacy.url, "model_info", timeout_s=1)["weight_version"] == "3"
    assert current.gets == ["/model_info"] * 3
    assert legacy.gets == ["/model_info"] + ["/get_model_info"] * 3
    assert http_info(legacy.url + "/", "server_info", timeout_s=1) == {"weight_version": "3"}
    assert legacy.gets[-1] == "/get_server_info"  # the server is known: no second probe
