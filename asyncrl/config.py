"""The run configuration: one typed tree assembled from the sections the components own.

A config is a YAML file plus dotted `key=value` overrides. Everything is validated before any
process starts; an error names the key and the allowed values (`ConfigError`, one line).
Cross-field checks live in `Config._check`, nowhere else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, model_validator

from asyncrl.algo.config import AlgoConfig
from asyncrl.configbase import Section, type_or
from asyncrl.metrics.config import MetricsConfig
from asyncrl.model_config import ModelConfig
from asyncrl.profiling import ProfileConfig
from asyncrl.queue import QueueConfig
from asyncrl.redis_conn import RedisConfig, redact_url
from asyncrl.rollout.config import RolloutConfig
from asyncrl.sglang.config import SglangWeightsConfig
from asyncrl.tasks.config import ArithmeticTaskConfig, TaskConfig, agent_of
from asyncrl.trainer.config import TrainerConfig
from asyncrl.weights.config import BroadcastWeightsConfig, StoreWeightsConfig

WeightsConfig = Annotated[
    Annotated[BroadcastWeightsConfig, Tag("broadcast")]
    | Annotated[StoreWeightsConfig, Tag("store")]
    | Annotated[SglangWeightsConfig, Tag("sglang")],
    Discriminator(type_or("broadcast")),
]
"""The weight-sync transports, by `type`: the seam's own (`asyncrl.weights.config`) and SGLang's;
`type` left out: `broadcast`."""


class ConfigError(ValueError):
    """A config problem, phrased as one line naming the key."""


class RunConfig(Section):
    id: str = Field(default="run", pattern=r"^[A-Za-z0-9_.-]+$")
    """Run name; all Redis keys live under `asyncrl:{id}:`."""
    dir: str = "runs/{run.id}"
    """Run directory: resolved config, metrics.jsonl, checkpoints/, logs/, redis/ (local mode)."""
    mode: Literal["async", "sync"] = "async"
    """`sync`: rollouts wait for the newest weights and the trainer trains only on groups of
    its current version (the baseline); `async`: neither side waits, staleness ≤ η."""
    seed: int = 0
    """Seed of the data order and of the samplers."""

    @property
    def path(self) -> Path:
        return Path(self.dir.replace("{run.id}", self.id))


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """Identity, directory and mode of the run."""
    redis: RedisConfig = Field(default_factory=RedisConfig)
    """Where the shared state lives."""
    queue: QueueConfig = Field(default_factory=QueueConfig)
    """Delivery rules of the streams."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The model trained and served."""
    task: TaskConfig = Field(default_factory=lambda: ArithmeticTaskConfig())
    """What the prompts are and how responses are scored."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """The rollout pool."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer pool."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """The objective."""
    weights: WeightsConfig = Field(default_factory=BroadcastWeightsConfig)
    """How new weights reach the rollout engines."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """Prometheus endpoint and the JSONL log."""
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    """On-demand torch.profiler traces of chosen steps (off by default)."""

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.rollout.sampling.temperature <= 0:
            raise ValueError(
                "rollout.sampling.temperature must be > 0 for training: behaviour log-probs of "
                "greedy decoding are not defined"
            )
        if self.algo.loss == "gspo" and self.algo.aggregation != "seq-mean-token-mean":
            raise ValueError("algo.aggregation must be seq-mean-token-mean when algo.loss=gspo")
        sampling = self.rollout.sampling
        sglang_engine = self.rollout.engine.type == "sglang"
        if sglang_engine and (sampling.top_p < 1 or sampling.top_k > 0):
            raise ValueError(
                "rollout.sampling.top_p must be 1 and top_k 0 with rollout.engine.type=sglang: "
                "SGLang's log-probs are not renormalised after truncation"
            )
        if sglang_engine != (self.weights.type == "sglang"):
            raise ValueError(
                "weights.type must be sglang exactly when rollout.engine.type=sglang: SGLang "
                "servers take weights only from the trainer's SGLang publisher "
                "(choose its transport with weights.transport: broadcast or store)"
            )
        if self.model.lora is not None and self.weights.type == "sglang":
            if self.weights.transport != "store":
                raise ValueError(
                    "model.lora with weights.type=sglang needs weights.transport=store: SGLang "
                    "servers load each adapter version from a peft directory in store_dir"
                )
            if self.model.lora.trainable_modules:
                raise ValueError(
                    "model.lora.trainable_modules must be empty with rollout.engine.type=sglang: "
                    "SGLang's adapters carry no modules_to_save"
                )
        if self.weights.type != "broadcast" and self.weights.store_dir is None:
            self.weights.store_dir = self.run.path / "weights"
        if self.model.build_tiny and self.task.type not in ("arithmetic", "agentic"):
            raise ValueError(
                "model.build_tiny needs task.type=arithmetic or agentic (its warm-up task)"
            )
        if self.algo.advantage in ("grpo", "drgrpo", "rloo") and self.rollout.n < 2:
            raise ValueError("rollout.n must be ≥ 2: group advantages need several samples")
        if self.algo.routing_replay and not self.rollout.capture_routing:
            raise ValueError(
                "algo.routing_replay needs rollout.capture_routing: true (the routing to replay)"
            )
        if (
            self.rollout.capture_routing
            and self.rollout.engine.type == "torch"
            and self.rollout.engine.prefix_cache_tokens
        ):
            raise ValueError(
                "rollout.capture_routing needs rollout.engine.prefix_cache_tokens=0: cached "
                "prompt tokens are not fed again, so their routing is not seen"
            )
        if self.trainer.groups_per_step % self.trainer.ranks:
            raise ValueError(
                f"trainer.groups_per_step={self.trainer.groups_per_step} must be a multiple of "
                f"trainer.ranks={self.trainer.ranks}: each rank trains an equal share"
            )
        if agent_of(self.task) is not None and self.task.environment is not None:
            raise ValueError(
                "task.agent and task.environment exclude each other: an agent runs its own loop"
            )
        if self.trainer.parallel == "fsdp" and self.trainer.eval_every:
            raise ValueError(
                "trainer.eval_every must be 0 with trainer.parallel=fsdp: evaluation runs on "
                "rank 0 alone, and a sharded model computes only with all ranks together"
            )
        return self

    def redacted(self) -> dict[str, Any]:
        """The resolved config as plain data with secrets removed (`--print-config`, logs)."""
        data = self.model_dump(mode="json")
        if data["redis"]["url"]:
            data["redis"]["url"] = redact_url(data["redis"]["url"])
        return data


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, cannot set {key}")
        node = child
    node[parts[-1]] = value


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """The config tree of dotted keys, e.g. {"run.id": "x"} → {"run": {"id": "x"}}."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        _set_dotted(tree, key, value)
    return tree


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r}: expected dotted key=value, e.g. run.id=exp1")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(data, key, value)
    return data


def _field_names(model: type[BaseModel] | None) -> list[str]:
    return sorted(model.model_fields) if model is not None else []


_MISSING = object()


def _child(node: Any, elem: int | str) -> Any:
    if isinstance(node, dict):
        return node.get(elem, _MISSING)
    if isinstance(node, list) and isinstance(elem, int) and 0 <= elem < len(node):
        return node[elem]
    return _MISSING


def _dotted_loc(loc: tuple[int | str, ...], data: Any) -> str:
    """The user's key path of a pydantic error location, without discriminator tags."""
    parts: list[str] = []
    node: Any = data
    for elem in loc:
        child = _child(node, elem)
        if child is _MISSING and isinstance(node, dict) and node.get("type", elem) == elem:
            # pydantic puts the `type` tag of a discriminated union in the location; the user
            # never wrote it as a key, so it stays out of the message.
            continue
        node = child
        parts.append(str(elem))
    return ".".join(parts) or "<root>"


def _section_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The section at a pydantic error location; at a union, the next element is the member's
    `type` tag, which picks the member."""
    model: Any = Config
    for part in loc:
        if isinstance(model, type) and issubclass(model, BaseModel):
            field = model.model_fields.get(str(part))
            model = None if field is None else field.annotation
        else:
            model = next((m for m in _members(model) if _tag(m) == part), None)
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _members(union: Any) -> list[Any]:
    return [get_args(m)[0] if get_origin(m) is Annotated else m for m in get_args(union)]


def _tag(model: Any) -> Any:
    field = getattr(model, "model_fields", {}).get("type")
    return None if field is None else field.default


def _format_error(err: Any, data: dict[str, Any]) -> str:
    key = _dotted_loc(tuple(err["loc"]), data)
    if err["type"] == "extra_forbidden":
        allowed = _field_names(_section_at(tuple(err["loc"])[:-1]))
        hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
        return f"{key}: unknown key{hint}"
    if err["type"] == "union_tag_invalid":
        # Every union of the tree is keyed by `type`; pydantic's message names its discriminator.
        return f"{key}.type: {err['ctx']['tag']!r} is not one of {err['ctx']['expected_tags']}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if key == "<root>" or msg.startswith(key + " ") or msg.startswith(key.split(".")[0] + "."):
        return msg
    got = err.get("input")
    shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
    return f"{key}: {msg}{shown}"


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Read `path` (YAML), apply overrides, validate. Raises ConfigError with one clear line."""
    data: Any = {}
    if path is not None:
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections")
    data = apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = [_format_error(e, data) for e in exc.errors()]
        raise ConfigError("; ".join(lines)) from None


def write_config(path: Path, settings: dict[str, Any]) -> Path:
    """Write a config file that `load_config` reads back, from dotted keys, e.g.
    {"run.id": "x", "trainer.max_steps": 5}; for tools and tests that start `asyncrl` processes."""
    path.write_text(yaml.safe_dump(nest(settings)))
    return path


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.redacted(), sort_keys=False)
