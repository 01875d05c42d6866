"""Config of the environments a task's episodes talk to (`task.environment`); chosen by `type`.
Nothing here imports torch or an HTTP client."""

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from asyncrl.configbase import PluginConfig, PluginPath, Section
from asyncrl.plugins import load_object


class PythonEnvironmentConfig(PluginConfig):
    """Your own `Environment` class (`asyncrl.environments.base`), run in the rollout worker's
    event loop: one instance per episode, `Class(**kwargs)`."""

    type: Literal["python"] = "python"
    """Environment backend."""

    timeout_s: float = Field(default=60.0, gt=0)
    """Seconds one `reset` or `step` may take before the episode fails (`env_timeout`)."""

    @field_validator("path")
    @classmethod
    def _resolve(cls, path: str, info: ValidationInfo) -> str:
        from asyncrl.environments.local import check_class

        check_class(path, info.data.get("python_path", []), info.data.get("kwargs", {}))
        return path


class RemoteEnvironmentConfig(Section):
    """Environments served by `asyncrl env-server` processes (any `Environment` class, in its
    own process or container); see `asyncrl.environments.client`. An episode's session lives on
    the server that created it."""

    type: Literal["remote"] = "remote"
    """Environment backend."""

    urls: list[str] = Field(min_length=1)
    """Base URLs of the env-servers (`http://host:port`); new episodes go round them."""

    timeout_s: float = Field(default=60.0, gt=0)
    """Seconds one call (create, step) may take, the environment's time included; past that
    the episode fails (`env_timeout`)."""

    connect_timeout_s: float = Field(default=5.0, gt=0)
    """Seconds to open a connection to a server."""

    max_sessions_per_server: int = Field(default=256, ge=1)
    """Calls in flight per server (and pooled connections to it); more wait their turn."""

    retries: int = Field(default=2, ge=0)
    """Further attempts, each on the next server of `urls`, when creating a session fails for
    the server's sake (down, full, timed out): an episode restarts freely before its first
    step, never after."""

    token_env: str = "ASYNCRL_ENV_SERVER_TOKEN"
    """Environment variable holding the run's env-server token (the shared secret the servers
    were started with; sent with every call)."""

    token_file: Path | None = None
    """File holding the token (e.g. a mounted Kubernetes Secret); wins over `token_env`."""

    max_reply_bytes: int = Field(default=16 << 20, ge=1)
    """Largest reply read from a server; a larger one fails its episode (`env_malformed`)."""

    @field_validator("urls")
    @classmethod
    def _http(cls, urls: list[str]) -> list[str]:
        return http_urls(urls)


def http_urls(urls: list[str]) -> list[str]:
    """Servers' base URLs without a trailing slash; ValueError for one that is no http URL."""
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r}: expected http://host:port")
    return [u.rstrip("/") for u in urls]


class ToolEnvironmentConfig(PluginPath):
    """Episodes in which the policy calls tools (`asyncrl.environments.tools`), run in the
    rollout worker's event loop. The episode's prompt is the item's chat messages when its task
    gave them (a dataset's message rows, every message kept), else its prompt as a user turn,
    after `system_prompt` when set, rendered by the chat template with the tools' schemas (in
    the system turn of Qwen-style templates); it replaces the task's own rendering.
    Each turn's `<tool_call>{json}</tool_call>` blocks are run and their results come back as
    `tool` chat messages; a turn without a call is the final answer, scored by the task's
    reward. `python_path` comes before `tools` because checking `tools` needs it."""

    type: Literal["tools"] = "tools"
    """Environment backend."""

    tools: list[str] = Field(min_length=1)
    """The tools, each "package.module:function" (sync or `async def`), imported when the config
    loads. A tool's name is its function's name; its JSON schema comes from the type hints and
    the docstring's `Args:` section (transformers' `get_json_schema`, when the role starts)."""

    timeout_s: float = Field(default=10.0, gt=0)
    """Seconds one tool call may take; past that the model is told it timed out
    (`tool_timeout`). A sync tool runs on a thread, which goes on to its end unseen, holding
    one of the tool's `threads_per_tool`."""

    threads_per_tool: int = Field(default=32, ge=1)
    """Calls of one sync tool running at once, in a worker, calls past their timeout whose
    function has not returned included; a call beyond them is refused at once and the model is
    told so (`tool_busy`). Per tool, so one tool's hung calls never hold up another's."""

    max_turns: int = Field(default=8, ge=1)
    """Policy turns per episode; the episode ends after this many even if the last one called
    tools (then scored like a final answer; its calls are not run)."""

    max_calls_per_turn: int = Field(default=8, ge=1)
    """Tool calls run per turn; the model is told the others were not (`too_many_calls`)."""

    max_result_chars: int = Field(default=8192, ge=1)
    """A tool result longer than this is cut to it, so one tool cannot flood the context."""

    system_prompt: str | None = None
    """A system message put before the prompt, unless the item's messages begin with a system
    message of their own (that one is kept); None: the chat template's default."""

    @field_validator("tools")
    @classmethod
    def _resolve(cls, paths: list[str], info: ValidationInfo) -> list[str]:
        names: dict[str, str] = {}
        for i, path in enumerate(paths):
            try:
                fn = load_object(path, info.data.get("python_path", []))
            except ValueError as exc:
                raise ValueError(f"[{i}] {exc}") from None
            name = getattr(fn, "__name__", path)
            if name in names:
                raise ValueError(f"[{i}] {path!r}: a tool named {name!r} is {names[name]!r}")
            names[name] = path
        return paths


EnvironmentConfig = Annotated[
    PythonEnvironmentConfig | RemoteEnvironmentConfig | ToolEnvironmentConfig,
    Field(discriminator="type"),
]
