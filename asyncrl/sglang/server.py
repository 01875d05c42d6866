"""`asyncrl serve`: the builtin torch engine behind SGLang's HTTP API, for machines without SGLang.

Same endpoints and JSON shapes as an SGLang server (see `asyncrl.sglang.engine` for the
release they follow), so the SGLang engine client and the SGLang weight publisher can be run and
tested on a CPU: /generate (one prompt or a batch), /health, /health_generate, /get_model_info,
/get_server_info, /pause_generation, /continue_generation, /flush_cache,
/init_weights_update_group, /update_weights_from_distributed, /update_weights_from_disk and
/destroy_weights_update_group.

Where it differs from SGLang, by design of the builtin engine:
- Weight updates are staged with `TorchEngine.stage_weights` and swapped in between two decode
  steps, so they land in flight even without a pause; replies report exact per-token versions
  as `meta_info.weight_versions` spans (plus `weight_version`, the last).
- Pause modes `in_place` and `retract` both hold running requests between two decode steps and
  let them go on with their KV cache (there is no radix cache to flush or recompute); `abort`
  ends them with finish reason "abort". New requests wait while paused.
- Weight versions must be integers (asyncrl's versions), so an update without one is refused.
- One request is generated at a time (the engine serialises `generate`); concurrent requests
  queue. It serves tests and small models, not throughput.

Binds to loopback by default: the API can replace the model's weights and has no auth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import threading
import uuid
from datetime import timedelta
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from asyncrl import __version__
from asyncrl.engines.base import Generation
from asyncrl.engines.config import SamplingParams, TorchEngineConfig
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.sglang.publisher import broadcast_tensors, join_update_group

log = logging.getLogger(__name__)

API_VERSION = "0.5.6"
"""The SGLang release whose HTTP API this server implements (pause modes included)."""
PAUSE_MODES = ("abort", "retract", "in_place")
GROUP_TIMEOUT = timedelta(seconds=60)


class ApiError(Exception):
    """A request the server refuses: HTTP 400 with SGLang's error body."""


class _Aborted(Exception):
    """Raised inside a running generate when a pause with mode abort ends it."""


def _sampling(raw: Any) -> SamplingParams:
    """SGLang sampling params → ours (only what the torch engine honours)."""
    raw = dict(raw or {})
    top_k = int(raw.get("top_k", -1))
    try:
        return SamplingParams(
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)),
            top_k=0 if top_k < 0 or top_k >= 1 << 30 else top_k,
            max_new_tokens=int(raw.get("max_new_tokens", 128)),
            stop_token_ids=tuple(raw["stop_token_ids"]) if raw.get("stop_token_ids") else None,
        )
    except ValueError as exc:
        raise ApiError(f"bad sampling_params: {exc}") from None


def _version(raw: Any) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ApiError(f"weight_version {raw!r} is not an integer") from None


class ServeApp:
    """The endpoints, independent of the HTTP plumbing."""

    def __init__(self, engine: TorchEngine, model_path: str, tokenizer: Any | None) -> None:
        self.engine = engine
        self.model_path = model_path
        self.tokenizer = tokenizer
        self._cond = threading.Condition()
        self._paused = False
        self._aborts = 0  # bumped by each pause with mode abort
        self._local = threading.local()  # `_aborts` when this thread's generate started
        self._groups: dict[str, dist.ProcessGroup] = {}
        engine.before_step = self._between_steps

    def _between_steps(self, step: int) -> None:
        """Runs on the generating thread before every decode step (see TorchEngine)."""
        with self._cond:
            if self._aborts != self._local.aborts:
                raise _Aborted
            self._cond.wait_for(lambda: not self._paused or self._aborts != self._local.aborts)
            if self._aborts != self._local.aborts:
                raise _Aborted

    # -- generation ----------------------------------------------------------------------------

    def generate(self, body: dict[str, Any]) -> Any:
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise ApiError("input_ids is required (a list of token ids or a list of such lists)")
        single = not isinstance(ids[0], list)
        prompts: list[list[int]] = [ids] if single else ids
        if any(not p or not all(isinstance(t, int) for t in p) for p in prompts):
            raise ApiError("every prompt must be a non-empty list of token ids")
        raw = body.get("sampling_params")
        if isinstance(raw, list):
            if len(raw) != len(prompts) or any(r != raw[0] for r in raw):
                raise ApiError("per-prompt sampling_params must all be equal here")
            raw = raw[0]
        params = _sampling(raw)
        with self._cond:
            self._local.aborts = self._aborts
        try:
            gens: list[Generation] | None = self.engine.generate(prompts, params)
        except _Aborted:
            gens = None
        logprobs = bool(body.get("return_logprob"))
        items = [
            self._item(p, None if gens is None else gens[i], logprobs)
            for i, p in enumerate(prompts)
        ]
        return items[0] if single else items

    def _item(self, prompt: list[int], gen: Generation | None, logprobs: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "prompt_tokens": len(prompt),
            "cached_tokens": 0,
            "weight_version": str(self.engine.version),
        }
        if gen is None:
            meta |= {
                "finish_reason": {"type": "abort", "message": "aborted by pause_generation"},
                "completion_tokens": 0,
            }
            if logprobs:
                meta["output_token_logprobs"] = []
            return {"text": "", "output_ids": [], "meta_info": meta}
        tokens = gen.token_ids.tolist()
        if gen.finish == "stop":
            finish = {"type": "stop", "matched": tokens[-1]}
        else:
            finish = {"type": "length", "length": len(tokens)}
        versions = gen.versions.tolist()
        spans: list[dict[str, Any]] = []
        for t, v in enumerate(versions):
            if spans and spans[-1]["version"] == str(v):
                spans[-1]["end"] = t + 1
            else:
                spans.append({"version": str(v), "start": t, "end": t + 1})
        meta |= {
            "finish_reason": finish,
            "completion_tokens": len(tokens),
            "weight_version": spans[-1]["version"],
            "weight_versions": spans,
        }
        if logprobs:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(gen.logprobs.tolist(), tokens, strict=True)
            ]
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": tokens, "meta_info": meta}

    def health_generate(self) -> None:
        with self._cond:
            if self._paused:
                return  # like SGLang: a busy or paused server is not probed with a request
        self.generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}})

    # -- pause ---------------------------------------------------------------------------------

    def pause(self, body: dict[str, Any]) -> dict[str, Any]:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ApiError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        with self._cond:
            self._paused = True
            if mode == "abort":
                self._aborts += 1
            self._cond.notify_all()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self) -> dict[str, Any]:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # -- weights -------------------------------------------------------------------------------

    def init_group(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            name = str(body.get("group_name", "weight_update_group"))
            if name in self._groups:
                raise ApiError(f"weight update group {name!r} exists")
            rank, world = int(body["rank_offset"]), int(body["world_size"])
            backend = str(body.get("backend", "nccl"))
            if backend != "gloo":
                raise ApiError(f"backend {backend!r}: this CPU server joins gloo groups only")
            host, port = str(body["master_address"]), int(body["master_port"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ApiError(f"bad init_weights_update_group request: {exc!r}") from None
        # The store client retries a refused connection for over twice its timeout (past two
        # minutes here), holding the request: look first, so that a trainer that is gone is
        # answered at once and an unreachable one after the timeout, each with a clear error.
        try:
            socket.create_connection((host, port), GROUP_TIMEOUT.total_seconds()).close()
        except OSError as exc:
            raise ApiError(f"cannot reach the trainer's store at {host}:{port}: {exc}") from None
        try:
            # As SGLang does: a client of the trainer's store, reached by a tcp:// rendezvous.
            url = f"tcp://{host}:{port}?rank={rank}&world_size={world}"
            store, _, _ = next(dist.rendezvous(url, timeout=GROUP_TIMEOUT))
        except RuntimeError as exc:  # c10d's DistError and kin
            raise ApiError(f"cannot join the trainer's store at {host}:{port}: {exc}") from None
        try:
            self._groups[name] = join_update_group(backend, store, rank, world, name, GROUP_TIMEOUT)
        except RuntimeError as exc:
            raise ApiError(f"could not join {name!r}: {exc}") from None
        return {"success": True, "message": f"joined {name} as rank {rank} of {world}"}

    def destroy_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        group = self._groups.pop(name, None)
        if group is None:
            raise ApiError(f"no weight update group {name!r}")
        dist.destroy_process_group(group)
        return {"success": True, "message": f"destroyed {name}"}

    def update_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        group = self._groups.get(name)
        if group is None:
            raise ApiError(f"no weight update group {name!r}")
        version = _version(body.get("weight_version"))
        try:
            names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
            tensors = {
                n: torch.empty(s, dtype=getattr(torch, d))
                for n, d, s in zip(names, dtypes, shapes, strict=True)
            }
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ApiError(f"bad update_weights_from_distributed request: {exc!r}") from None
        try:
            broadcast_tensors(group, list(tensors.values()))
        except RuntimeError as exc:
            # The group is unusable after a failed collective: drop it, the trainer re-forms.
            self._groups.pop(name, None)
            raise ApiError(f"receiving over {name!r} failed: {exc}") from None
        self._stage(tensors, version)
        return {"success": True, "message": f"Weight version updated to {version}."}

    def update_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        version = _version(body.get("weight_version"))
        path = Path(str(body.get("model_path", "")))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ApiError(f"{path} holds no safetensors files")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(f))
        self._stage(tensors, version)
        return {
            "success": True,
            "message": f"Weight version updated to {version}.",
            "num_paused_requests": 0,
        }

    def _stage(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        try:
            self.engine.stage_weights(tensors, version)
        except ValueError as exc:
            raise ApiError(str(exc)) from None

    # -- info ----------------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(self.engine.version),
        }

    def server_info(self) -> dict[str, Any]:
        return {
            "version": f"asyncrl-serve {__version__}",
            "api_version": API_VERSION,
            "model_path": self.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "weight_version": str(self.engine.version),
        }


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0].rstrip("/")
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw.strip() else {}
            if not isinstance(body, dict):
                raise ApiError("the request body must be a JSON object")
            routes = {
                "/generate": lambda: app.generate(body),
                "/get_model_info": app.model_info,
                "/get_server_info": app.server_info,
                "/pause_generation": lambda: app.pause(body),
                "/continue_generation": app.resume,
                "/init_weights_update_group": lambda: app.init_group(body),
                "/destroy_weights_update_group": lambda: app.destroy_group(body),
                "/update_weights_from_distributed": lambda: app.update_distributed(body),
                "/update_weights_from_disk": lambda: app.update_disk(body),
            }
            if path == "/health":
                self._reply(HTTPStatus.OK, None)
            elif path == "/health_generate":
                app.health_generate()
                self._reply(HTTPStatus.OK, None)
            elif path == "/flush_cache":
                # No radix cache here: nothing to flush, always a success (SGLang's text reply).
                self._reply(HTTPStatus.OK, "Cache flushed.\n")
            elif path in routes:
                self._reply(HTTPStatus.OK, routes[path]())
            else:
                self._reply(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})
        except (ApiError, ValueError) as exc:
            self._reply(HTTPStatus.BAD_REQUEST, _error(str(exc), HTTPStatus.BAD_REQUEST))
        except Exception as exc:  # a bug must answer 500, never take the server down
            log.exception("%s failed", path)
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, _error(repr(exc), 500))

    def _reply(self, status: HTTPStatus, obj: Any) -> None:
        if obj is None:
            data, kind = b"", "text/plain"
        elif isinstance(obj, str):
            data, kind = obj.encode(), "text/plain"
        else:
            data, kind = json.dumps(obj).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def _error(message: str, code: int) -> dict[str, Any]:
    """SGLang's error body (its `ErrorResponse`)."""
    return {
        "object": "error",
        "message": message,
        "type": "BadRequest",
        "param": None,
        "code": code,
    }


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], app: ServeApp) -> None:
        super().__init__(address, _Handler)
        self.app = app


def make_server(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    dtype: str = "float32",
    seed: int = 0,
) -> _Server:
    """A server (not yet serving) for the model directory `model_path`, whose weights are
    version 0 as everywhere in asyncrl; port 0 picks a free one."""
    from transformers import AutoTokenizer

    cfg = TorchEngineConfig.model_validate({"device": "cpu", "dtype": dtype, "seed": seed})
    engine = TorchEngine.from_config(cfg, model_path=model_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError):  # a model without tokenizer files: replies carry no text
        tokenizer = None
    return _Server((host, port), ServeApp(engine, model_path, tokenizer))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = make_server(
        args.model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        seed=args.seed,
    )
    # One line on stdout, flushed: how a parent that asked for port 0 learns the port.
    print(f"asyncrl serve: listening on http://{args.host}:{server.server_port}", flush=True)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
    finally:
        server.server_close()
    return 0
