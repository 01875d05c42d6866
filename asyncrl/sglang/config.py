"""Config of the SGLang engine and of weight sync into SGLang servers. Nothing of SGLang (or
torch) is imported here, so configs validate anywhere."""

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.configbase import Section
from asyncrl.weights.fields import GroupFields, StoreFields


class SglangEngineConfig(Section):
    """SGLang servers driven over HTTP (`asyncrl.sglang.engine`); nothing of SGLang is imported
    here, so the servers may run from their own environment (SGLang pins its own torch).
    Weights reach them through the trainer's SGLang publisher (`weights.type: sglang`)."""

    type: Literal["sglang"] = "sglang"
    """Engine backend."""

    urls: list[str] | None = None
    """Base URLs of running servers to attach to, e.g. ["http://10.0.0.5:30000"]. Each must
    serve this run's model and report weight version 0 at first (`--weight-version 0`; SGLang's
    default name "default" is read as 0 too). None: `launch` must be true."""

    launch: bool = False
    """Start the servers here with `{python} -m sglang.launch_server` and stop them on exit."""

    servers: int = Field(default=1, ge=1)
    """Servers to launch (with `launch`); server i listens on `port + i`."""

    python: str = "python"
    """Interpreter that has SGLang installed (with `launch`); e.g. a separate venv's python."""

    host: str = "127.0.0.1"
    """Bind address of launched servers; the engine and the trainer reach them there."""

    port: int = Field(default=30000, ge=1, le=65535)
    """Port of the first launched server."""

    device: Literal["cuda", "npu", "cpu"] = "cuda"
    """Device kind of launched servers: their `--device` flag and visible-devices variable."""

    devices_per_server: int = Field(default=1, ge=1)
    """Accelerators each launched server sees (server i gets devices i·k … i·k+k−1); set the
    matching `--tp-size` in `server_args`."""

    server_args: dict[str, str | int | float | bool] = Field(default_factory=dict)
    """Extra `launch_server` flags, e.g. {"mem_fraction_static": 0.7}; `name: true` passes a
    bare flag `--name`, false omits it."""

    startup_timeout_s: float = Field(default=900.0, gt=0)
    """Longest wait for a launched server's /health (model loading, graph capture)."""

    timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for one /generate reply; a server past it counts as dead."""

    retries: int = Field(default=3, ge=0)
    """Further attempts of a failed request (on another server when there is one)."""

    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubled at each further one (with jitter)."""

    backoff_max_s: float = Field(default=10.0, ge=0)
    """Cap of the retry wait."""

    health_interval_s: float = Field(default=5.0, gt=0)
    """A dead server's /health is asked at most this often; it rejoins once it answers 200."""

    health_timeout_s: float = Field(default=5.0, gt=0)
    """Longest wait for one /health answer."""

    chunk_size: int = Field(default=8, ge=1)
    """Prompts per /generate request; chunks are spread over the live servers."""

    max_concurrency: int = Field(default=64, ge=1)
    """Requests in flight at once over all servers (the client's thread pool)."""

    @model_validator(mode="after")
    def _check(self) -> "SglangEngineConfig":
        if self.launch and self.urls:
            raise ValueError(
                "rollout.engine: set either urls (attach) or launch: true (start servers), not both"
            )
        if not self.launch and not self.urls:
            raise ValueError(
                "rollout.engine.urls is empty: give the servers' URLs or set "
                "rollout.engine.launch: true"
            )
        return self


class SglangWeightsConfig(GroupFields, StoreFields):
    """Weights sent by the trainer into the SGLang servers through their own update API
    (`asyncrl.sglang.publisher`); the rollout workers only register their servers' URLs."""

    type: Literal["sglang"] = "sglang"
    """Weight-sync backend; needs `rollout.engine.type: sglang`."""

    transport: Literal["broadcast", "store"] = "broadcast"
    """`broadcast`: a collective group of trainer rank 0 and every server's TP ranks
    (`/update_weights_from_distributed`). `store`: safetensors directories in `store_dir` that
    each server loads (`/update_weights_from_disk`); the servers must see `store_dir`."""

    pause_mode: Literal["retract", "in_place", "none"] = "retract"
    """How the trainer's publisher quiets a server for a weight update. `retract`: running
    requests go back to the queue and are recomputed under the new weights (the KV cache is
    flushed: no key computed by old weights survives). `in_place`: they keep their KV cache and
    go on after the update (cache not flushed). `none`: no pause; SGLang then applies the update
    once the running requests have finished. Needs SGLang ≥ 0.5.6; older servers are not
    paused."""
