"""Config of agents trained through the gateway (`task.agent`) and of the gateway itself
(`rollout.gateway`). Nothing here imports torch or an HTTP client."""

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from asyncrl.configbase import PluginConfig, Section
from asyncrl.plugins import call_shape, check_signature, load_object


class PythonAgentConfig(PluginConfig):
    """Your own agent, unchanged: `fn(item, base_url=..., api_key=..., **kwargs)` (an
    `async def`, or a plain function run on a thread of its own), called once per episode.
    `item` is a plain dict (`id`, `prompt`, `answer`); `base_url` and `api_key` are the
    episode's OpenAI credentials (`OpenAI(base_url=base_url, api_key=api_key)`), valid while
    it runs. It returns the episode's reward (a number), one reward per call it made (a list),
    or None: the task's reward then scores the content of its last answer."""

    type: Literal["python"] = "python"
    """Agent backend."""

    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds one episode's agent may run; past that its group fails (`agent_timeout`) and
    its session's calls are refused."""

    max_calls: int = Field(default=32, ge=1)
    """Calls one episode may make; the next one fails its group (`agent_over_budget`)."""

    max_tokens: int | None = Field(default=None, ge=1)
    """Tokens one episode may generate over all its calls (a call's `max_tokens` is cut to
    what is left); a call with none left fails its group (`agent_over_budget`). None: no
    bound beyond `max_calls` × `rollout.sampling.max_new_tokens`."""

    @field_validator("path")
    @classmethod
    def _resolve(cls, path: str, info: ValidationInfo) -> str:
        kwargs = info.data.get("kwargs", {})
        fn = load_object(path, info.data.get("python_path", []))
        shape = call_shape("fn", ["item", "base_url=...", "api_key=..."], kwargs)
        check_signature(fn, shape, {}, base_url="", api_key="", **kwargs)
        return path


AgentConfig = PythonAgentConfig
"""The agent backends (one so far; a union by `type` when a second comes)."""


class GatewayConfig(Section):
    """The OpenAI-compatible endpoint a rollout worker serves its agents' calls on
    (`asyncrl.gateway`); every call needs a live episode's credentials."""

    host: str = "127.0.0.1"
    """Address it binds; loopback by default, where the agents run in the worker's process."""

    port: int = Field(default=0, ge=0, lt=1 << 16)
    """Port it binds; 0: a free one (each worker of a host gets its own)."""
