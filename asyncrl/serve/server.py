"""`asyncrl serve`: the builtin torch engine behind SGLang's HTTP API, for machines without SGLang.

Same endpoints and JSON shapes as an SGLang 0.5.23 server, so the SGLang engine client, the
SGLang weight publisher, SGLang's own client code (`RuntimeEndpoint`, the `sgl.function`
frontend) and the `openai` package can be run against it on a CPU. The endpoints are the
`ROUTES` table: /generate (`asyncrl.api.native`: text or ids, batches, `n`, stop strings and
ids, log-prob options, SSE), the OpenAI-compatible /v1/* (`asyncrl.api.openai`; /v1/responses
through `asyncrl.api.responses`),
/health, /health_generate, /model_info and /server_info (and their deprecated names /get_*),
/flush_cache, /pause_generation, /continue_generation, /init_weights_update_group,
/update_weights_from_distributed, /update_weights_from_disk, /destroy_weights_update_group,
/update_weight_version, /load_lora_adapter, /unload_lora_adapter.

Where it differs from SGLang, by design of the builtin engine:
- Weight updates are staged with `TorchEngine.stage_weights` and swapped in between two decode
  steps, so they land in flight even without a pause; replies report exact per-token versions
  as `meta_info.weight_versions` spans (plus `weight_version`, the last).
- Pause modes `in_place` and `retract` both hold running requests between two decode steps and
  let them go on with their KV cache (there is no radix cache to flush or recompute); `abort`
  ends them with finish reason "abort". New requests wait while paused.
- Weight versions must be integers (asyncrl's versions), so an update without one is refused.
- Log-probs of prompt tokens and top alternatives come from one extra forward pass over
  prompt + response after generating (so they use the weights at the end of the request).
- `stream` sends the finished generation as SSE chunks (one per token): the engine does not
  hand tokens out while it decodes.
- LoRA adapters (peft directories, loaded by path under a name) need no `--enable-lora` and
  have no rank or count limit; they are applied unmerged, as the trainer computes them, and a
  request names one in `lora_path` as in SGLang (an adapter unloaded since is reloaded from its
  path, a name never loaded is refused). Requests of different adapters take turns.
- One request is generated at a time (the engine serialises `generate`); concurrent requests
  queue. It serves tests and small models, not throughput.
- Requests are bounded beyond the model's context, each a 400 naming the key: `n` (`native.MAX_N`),
  prompts × `n` (`native.MAX_JOBS`), chat messages (`openai.MAX_MESSAGES`); a body over
  `asyncrl.web.threaded.MAX_BODY_BYTES` is a 413, refused unread.

Binds to loopback by default: the API can replace the model's weights and has no auth.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file

from asyncrl import __version__
from asyncrl.api import native, openai, responses
from asyncrl.api.native import Job, Output, Spec
from asyncrl.engines.base import Generation
from asyncrl.engines.config import TorchEngineConfig
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.web.serving import serve_until_interrupted
from asyncrl.web.threaded import ApiError, Body, JsonHandler, Stream
from asyncrl.weights.groups import broadcast_all, join_update_group

log = logging.getLogger(__name__)

API_VERSION = "0.5.23"
"""The SGLang release whose HTTP API this server implements (pause modes included)."""
PAUSE_MODES = ("abort", "retract", "in_place")
GROUP_TIMEOUT = timedelta(seconds=60)


class _Aborted(Exception):
    """Raised inside a running generate when a pause with mode abort ends it."""


def _version(raw: Any) -> int:
    try:
        return int(raw)
    except (TypeError, ValueError, OverflowError):  # OverflowError: JSON's Infinity
        raise ApiError(f"weight_version {raw!r} is not an integer") from None


class ServeApp:
    """The endpoints, independent of the HTTP plumbing."""

    def __init__(self, engine: TorchEngine, model_path: str, tokenizer: Any | None) -> None:
        self.engine = engine
        self.model_path = model_path
        config = engine.model.config
        self.model = native.Model(
            tokenizer,
            engine.eos_token_ids,
            int(config.vocab_size),
            getattr(config, "max_position_embeddings", None),
            engine.capture_routing,
        )
        self._cond = threading.Condition()
        self._paused = False
        self._aborts = 0  # bumped by each pause with mode abort
        self._local = threading.local()  # `_aborts` when this thread's generate started
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._adapter_lock = threading.Lock()  # the active adapter, held while it generates
        self._adapters: dict[str, str] = {}  # loaded adapters: name → path
        self._known: dict[str, str] = {}  # every adapter ever loaded (SGLang's lora_ref_cache)
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

    def generate(self, body: Body) -> Any:
        """SGLang's /generate: a reply object, a list for a batch (or `n` > 1), or a stream."""
        req = native.parse_generate(body, self.model)
        outs = self.run(req.jobs)
        version = self.engine.version
        if req.stream:
            return Stream(native.stream_chunks(req, outs, self.model, version))
        items = [
            native.item(job, out, self.model, version)
            for job, out in zip(req.jobs, outs, strict=True)
        ]
        return items[0] if req.single else items

    def run(self, jobs: list[Job]) -> list[Output]:
        """Generate every job (jobs of equal sampling share engine calls), then score those that
        ask for prompt log-probs or alternatives. A pause with mode abort ends the request."""
        outs: dict[int, Output] = {}
        groups: dict[tuple[Spec, str | None], list[int]] = {}
        for i, job in enumerate(jobs):
            if job.lora is not None and job.lora not in self._known:
                raise ApiError(
                    f"Got LoRA adapter that has never been loaded: {job.lora}\n"
                    f"All loaded adapters: {list(self._known)}.",
                    "lora_path",
                )
            groups.setdefault((job.spec, job.lora), []).append(i)
        with self._cond:
            self._local.aborts = self._aborts
        for (spec, lora), rows in groups.items():
            with self._using(lora):
                self._run_group(jobs, rows, spec, outs)
        return [outs[i] for i in range(len(jobs))]

    def _run_group(
        self, jobs: list[Job], rows: list[int], spec: Spec, outs: dict[int, Output]
    ) -> None:
        gens: list[Generation | None]
        if spec.max_new_tokens == 0:
            gens = [native.empty_generation(self.engine.version)] * len(rows)
        else:
            params = spec.engine_params()
            try:
                gens = list(
                    self.engine.generate(
                        [jobs[i].prompt for i in rows],
                        params,
                        min_new_tokens=spec.min_new_tokens,
                    )
                )
            except _Aborted:
                gens = [None] * len(rows)
        for i, gen in zip(rows, gens, strict=True):
            outs[i] = native.finish(jobs[i], gen, self.model)
        scored = [
            i for i, gen in zip(rows, gens, strict=True) if gen is not None and jobs[i].scores
        ]
        if scored:
            seqs = [jobs[i].prompt + outs[i].tokens for i in scored]
            logps = self.engine.score(seqs, spec.score_params())
            for i, logp in zip(scored, logps, strict=True):
                outs[i].logp = logp

    def health_generate(self, body: Body) -> None:
        with self._cond:
            if self._paused:
                return  # like SGLang: a busy or paused server is not probed with a request
        self.generate({"input_ids": [0], "sampling_params": {"max_new_tokens": 1}})

    # -- OpenAI ----------------------------------------------------------------------------------

    def v1_models(self, body: Body) -> Any:
        return openai.models(self.model_path)

    def v1_completions(self, body: Body) -> Any:
        return self._openai(openai.parse_completion(body, self.model))

    def v1_chat_completions(self, body: Body) -> Any:
        return self._openai(openai.parse_chat(body, self.model))

    def v1_responses(self, body: Body) -> Any:
        return responses.respond(body, self.v1_chat_completions)

    def _openai(self, req: openai.OpenAIRequest) -> Any:
        out = openai.reply(req, self.run(req.jobs), self.model, self.model_path)
        return Stream(out) if req.stream else out

    def flush_cache(self, body: Body) -> str:
        # No radix cache here: nothing to flush, always a success (SGLang's text reply).
        return "Cache flushed.\n"

    def health(self, body: Body) -> None:
        return None

    # -- pause ---------------------------------------------------------------------------------

    def pause(self, body: Body) -> dict[str, Any]:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise ApiError(f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        with self._cond:
            self._paused = True
            if mode == "abort":
                self._aborts += 1
            self._cond.notify_all()
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: Body) -> dict[str, Any]:
        with self._cond:
            self._paused = False
            self._cond.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # -- weights -------------------------------------------------------------------------------

    def init_group(self, body: Body) -> dict[str, Any]:
        try:
            name = str(body.get("group_name", "weight_update_group"))
            if name in self._groups:
                raise ApiError(f"weight update group {name!r} exists")
            rank, world = int(body["rank_offset"]), int(body["world_size"])
            backend = str(body.get("backend", "nccl"))
            if backend != "gloo":
                raise ApiError(f"backend {backend!r}: this CPU server joins gloo groups only")
            host, port = body["master_address"], int(body["master_port"])
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ApiError(f"bad init_weights_update_group request: {exc!r}") from None
        if not isinstance(host, str) or not 0 < port < 1 << 16:
            raise ApiError(
                f"master_address {host!r}, master_port {port}: a host name and a TCP port",
                "master_address" if not isinstance(host, str) else "master_port",
            )
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

    def destroy_group(self, body: Body) -> dict[str, Any]:
        name = str(body.get("group_name", "weight_update_group"))
        group = self._groups.pop(name, None)
        if group is None:
            raise ApiError(f"no weight update group {name!r}")
        dist.destroy_process_group(group)
        return {"success": True, "message": f"destroyed {name}"}

    def update_distributed(self, body: Body) -> dict[str, Any]:
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
            broadcast_all(group, list(tensors.values()))
        except RuntimeError as exc:
            # The group is unusable after a failed collective: drop it, the trainer re-forms.
            self._groups.pop(name, None)
            raise ApiError(f"receiving over {name!r} failed: {exc}") from None
        self._stage(tensors, version)
        return {"success": True, "message": f"Weight version updated to {version}."}

    def update_disk(self, body: Body) -> dict[str, Any]:
        version = _version(body.get("weight_version"))
        path = Path(str(body.get("model_path", "")))
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ApiError(f"{path} holds no safetensors files")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                tensors.update(load_file(f))
            except (OSError, SafetensorError) as exc:
                raise ApiError(f"cannot load {f}: {exc}", "model_path") from None
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

    def update_weight_version(self, body: Body) -> dict[str, Any]:
        version = _version(body.get("new_version"))
        if body.get("abort_all_requests", True):  # SGLang's default
            with self._cond:
                self._aborts += 1
                self._cond.notify_all()
        try:
            self.engine.relabel(version)
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        return {
            "success": True,
            "message": f"Weight version updated to {version}",
            "new_version": str(version),
        }

    # -- LoRA adapters -------------------------------------------------------------------------

    def load_lora_adapter(self, body: Body) -> dict[str, Any]:
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            raise ApiError("load_lora_adapter needs lora_name and lora_path", "lora_name")
        with self._adapter_lock:
            if name in self._adapters:
                raise ApiError(
                    f"Failed to load LoRA adapter {name} because it is already loaded",
                    "lora_name",
                )
            self._load(name, path)
            return self._lora_reply()

    def unload_lora_adapter(self, body: Body) -> dict[str, Any]:
        name = body.get("lora_name")
        if not isinstance(name, str):
            raise ApiError("unload_lora_adapter needs lora_name", "lora_name")
        with self._adapter_lock:
            if name not in self._adapters:
                raise ApiError(
                    f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self._adapters)}",
                    "lora_name",
                )
            model: Any = self.engine.model  # a PeftModel once an adapter is loaded
            if len(self._adapters) == 1:
                self.engine.model = model.unload()  # the last one: back to the plain base
            else:
                model.delete_adapter(name)
            del self._adapters[name]
            return self._lora_reply()

    def _load(self, name: str, path: str) -> None:
        """Caller holds `_adapter_lock`. The first adapter wraps the engine's model in peft's
        `PeftModel` (the trainer's LoRA layers, unmerged); the others join it."""
        from peft import PeftModel

        model: Any = self.engine.model
        try:
            if isinstance(model, PeftModel):
                model.load_adapter(path, adapter_name=name)
            else:
                model = PeftModel.from_pretrained(model, path, adapter_name=name)
                self.engine.model = model
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ApiError(f"loading LoRA adapter {name} from {path} failed: {exc}") from None
        self._adapters[name] = self._known[name] = path

    @contextlib.contextmanager
    def _using(self, lora: str | None) -> Iterator[None]:
        """Generate with adapter `lora` (None: the base model), reloading it from its path if it
        was unloaded since (as SGLang does)."""
        with self._adapter_lock:
            if lora is None:
                model: Any = self.engine.model
                with model.disable_adapter() if self._adapters else contextlib.nullcontext():
                    yield
                return
            if lora not in self._adapters:
                self._load(lora, self._known[lora])
            model = self.engine.model
            model.set_adapter(lora)
            yield

    def _lora_reply(self) -> dict[str, Any]:
        return {"success": True, "error_message": None, "loaded_adapters": dict(self._adapters)}

    # -- info ----------------------------------------------------------------------------------

    def model_info(self, body: Body) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(self.engine.version),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(self.engine.model.config, "model_type", None),
            "architectures": getattr(self.engine.model.config, "architectures", None),
        }

    def server_info(self, body: Body) -> dict[str, Any]:
        return {
            "version": f"asyncrl-serve {__version__}",
            "api_version": API_VERSION,
            "model_path": self.model_path,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "weight_version": str(self.engine.version),
        }


class _Handler(JsonHandler):
    server: _Server

    def route(self, path: str, body: Body) -> Any:
        route = ROUTES.get(path)
        if route is None:
            raise ApiError("Not Found", None, HTTPStatus.NOT_FOUND)
        return route(self.server.app, body)


Route = Callable[[ServeApp, Body], Any]
ROUTES: dict[str, Route] = {
    "/generate": ServeApp.generate,
    "/health": ServeApp.health,
    "/health_generate": ServeApp.health_generate,
    "/model_info": ServeApp.model_info,
    "/server_info": ServeApp.server_info,
    # The older names, deprecated but still served by SGLang 0.5.23.
    "/get_model_info": ServeApp.model_info,
    "/get_server_info": ServeApp.server_info,
    "/flush_cache": ServeApp.flush_cache,
    "/pause_generation": ServeApp.pause,
    "/continue_generation": ServeApp.resume,
    "/init_weights_update_group": ServeApp.init_group,
    "/destroy_weights_update_group": ServeApp.destroy_group,
    "/update_weights_from_distributed": ServeApp.update_distributed,
    "/update_weights_from_disk": ServeApp.update_disk,
    "/update_weight_version": ServeApp.update_weight_version,
    "/load_lora_adapter": ServeApp.load_lora_adapter,
    "/unload_lora_adapter": ServeApp.unload_lora_adapter,
    "/v1/models": ServeApp.v1_models,
    "/v1/completions": ServeApp.v1_completions,
    "/v1/chat/completions": ServeApp.v1_chat_completions,
    "/v1/responses": ServeApp.v1_responses,
}
"""Path → handler: an endpoint is one `ServeApp` method taking the JSON body (`{}` for a GET)
and returning the reply (an object as JSON, a str as text, None as an empty 200, a `Stream`
as SSE; raise `ApiError` for a 400), plus one line here."""


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
    routed_experts: bool = False,
) -> _Server:
    """A server (not yet serving) for the model directory `model_path`, whose weights are
    version 0 as everywhere in asyncrl; port 0 picks a free one; `routed_experts` records each
    token's experts for requests that ask (an MoE model)."""
    from transformers import AutoTokenizer

    cfg = TorchEngineConfig.model_validate({"device": "cpu", "dtype": dtype, "seed": seed})
    engine = TorchEngine.from_config(cfg, model_path=model_path, capture_routing=routed_experts)
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
        routed_experts=args.enable_return_routed_experts,
    )
    return serve_until_interrupted("serve", args.host, server)
