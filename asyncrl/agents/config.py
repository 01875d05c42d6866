"""Config of agents trained through the gateway (`task.agent`; a verifiers environment's runner,
`task.type: verifiers`). Nothing here imports torch or an HTTP client."""

import os
import shutil
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator

from asyncrl.configbase import PluginConfig, Section, type_or
from asyncrl.environments.config import http_urls
from asyncrl.plugins import call_shape, check_signature, load_object


class AgentLimits(Section):
    """What one episode's agent may spend, whatever runs it."""

    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds one episode's agent may run; past that its group fails (`agent_timeout`) and
    its session's calls are refused."""

    max_calls: int = Field(default=32, ge=1)
    """Calls one episode may make; the next one fails its group (`agent_over_budget`)."""

    max_tokens: int | None = Field(default=None, ge=1)
    """Tokens one episode may generate over all its calls (a call's `max_tokens` is cut to
    what is left); a call with none left fails its group (`agent_over_budget`). None: no
    bound beyond `max_calls` × `rollout.sampling.max_new_tokens`."""


class PythonAgentConfig(PluginConfig, AgentLimits):
    """Your own agent, unchanged: `fn(item, base_url=..., api_key=..., **kwargs)` (an
    `async def`, or a plain function run on a thread of its own), called once per episode.
    `item` is a plain dict (`id`, `prompt`, `answer`); `base_url` and `api_key` are the
    episode's OpenAI credentials (`OpenAI(base_url=base_url, api_key=api_key)`), valid while
    it runs. It returns the episode's reward (a number), one reward per call it made (a list),
    or None: the task's reward then scores the content of its last answer."""

    type: Literal["python"] = "python"
    """Agent backend."""

    @field_validator("path")
    @classmethod
    def _resolve(cls, path: str, info: ValidationInfo) -> str:
        kwargs = info.data.get("kwargs", {})
        fn = load_object(path, info.data.get("python_path", []))
        shape = call_shape("fn", ["item", "base_url=...", "api_key=..."], kwargs)
        check_signature(fn, shape, {}, base_url="", api_key="", **kwargs)
        return path


class CommandAgentConfig(AgentLimits):
    """Any executable as the agent (another language, a CLI coding agent, a script in a venv of
    its own): started once per episode in a process group of its own, with the episode's
    credentials as `OPENAI_BASE_URL` / `OPENAI_API_KEY` and the item as `ASYNCRL_ITEM` (JSON:
    `id`, `prompt`, `answer`; also on its stdin). Its reward is its last stdout line: a JSON
    number, a list of them (one per call) or `null`; with `null` or no output, a reward it
    POSTed to `{OPENAI_BASE_URL}/reward`, else the task's reward of its last answer. A
    non-zero exit or any other last line fails its group (`agent_error`, stderr's tail as
    detail); the process group is killed when the episode ends or is given up."""

    type: Literal["command"]
    """Agent backend."""

    cwd: str | None = None
    """Its working directory; None: the rollout worker's."""

    argv: list[str] = Field(min_length=1)
    """The command and its arguments (no shell: `["bash", "-c", "..."]` for one); checked to
    be an executable (on PATH, or a path from `cwd`) when the config loads."""

    env: dict[str, str] = Field(default_factory=dict)
    """Variables added to the worker's environment for it (the episode's own win)."""

    @field_validator("argv")
    @classmethod
    def _found(cls, argv: list[str], info: ValidationInfo) -> list[str]:
        # A typo is one config error when the run starts, not a failed group per episode.
        program = argv[0]
        if "/" in program and info.data.get("cwd"):
            program = os.path.join(info.data["cwd"], program)
        if shutil.which(program) is None:
            raise ValueError(f"{argv[0]!r} is no executable file (nor on PATH)")
        return argv


class RemoteAgentConfig(AgentLimits):
    """Agents on runners of their own (`asyncrl agent-server`: other containers or machines):
    each episode is one request to one runner, new episodes going round `urls`; the runner
    runs its python or command agent against the episode's gateway session, so that gateway
    must be reachable from the runners (`rollout.gateway.host`, `advertise_host`). A runner
    refusing or unreachable when the episode starts: the next is tried (`start_within_s`);
    none takes it, or the one running it dies mid-episode: its group fails
    (`agent_unavailable`)."""

    type: Literal["remote"]
    """Agent backend."""

    urls: list[str] = Field(min_length=1)
    """Base URLs of the runners (`http://host:port`)."""

    connect_timeout_s: float = Field(default=5.0, gt=0)
    """Seconds to reach a runner before the next is tried."""

    start_within_s: float = Field(default=60.0, ge=0)
    """Seconds an episode waits for a runner to take it, going round them again (half a
    second apart at first, then up to 5): a runner restarting or all of them busy holds the
    episode back rather than failing it. Past it, its group fails (`agent_unavailable`).
    Counted in `timeout_s`."""

    token_env: str = "ASYNCRL_AGENT_SERVER_TOKEN"
    """Environment variable holding the runners' token (the shared secret they were started
    with; sent with every episode)."""

    token_file: Path | None = None
    """File holding the token (e.g. a mounted Kubernetes Secret); wins over `token_env`."""

    @field_validator("urls")
    @classmethod
    def _http(cls, urls: list[str]) -> list[str]:
        return http_urls(urls)


AgentConfig = Annotated[
    Annotated[PythonAgentConfig, Tag("python")]
    | Annotated[CommandAgentConfig, Tag("command")]
    | Annotated[RemoteAgentConfig, Tag("remote")],
    Discriminator(type_or("python")),
]
"""The agent backends, by `type`; left out: `python`."""


class VerifiersConfig(AgentLimits):
    """A verifiers environment's runner: which environment, in which venv, over which splits
    (`asyncrl.agents.verifiers`); `task.type: verifiers` is this and nothing else."""

    type: Literal["verifiers"] = "verifiers"
    """Task backend: the task is its own agent."""

    env: str = Field(min_length=1)
    """The environment: a taskset id as verifiers resolves it, i.e. an importable package
    (installed in `python`'s venv, or found on `python_path`) exporting its `vf.Taskset`
    (and optionally an `Env`) via `__all__`."""

    python: str
    """Interpreter of the venv verifiers is installed in (`pip install 'asyncrl[verifiers]'`
    there): verifiers 0.4 needs `openai<3`, the Agents SDK `openai>=3`, so it is a venv of its
    own. Checked when a role starts."""

    python_path: list[str] = Field(default_factory=list)
    """Directories put first on the runner's `sys.path` (a local environment package's parent)."""

    env_args: dict[str, Any] = Field(default_factory=dict)
    """verifiers' own env config (what `--env.*` sets on `vf-eval`): e.g. `{taskset: {num_tasks:
    50}, agent: {max_turns: 4}}`; `taskset.id` is `env`."""

    runtime: str = "subprocess"
    """Where the harness program runs (verifiers' `agent.runtime.type`): `subprocess`, the
    local machine (verifiers' own default is `prime`, a hosted sandbox that needs a login), or
    `docker`, `podman`, `prime`, ... as verifiers knows them."""

    train_select: dict[str, Any] = Field(default_factory=dict)
    """The train split: verifiers' `SelectConfig` over the taskset (`include`/`exclude` by
    `idx` ranges, ids or names, `shuffle`, `seed`, `skip`, `limit`), e.g. `{exclude: {idx:
    ["0:20"]}}`; {}: every task."""

    eval_select: dict[str, Any] | None = None
    """The held-out split, the same way (e.g. `{include: {idx: ["0:20"]}}`); None: none."""

    traces_dir: str | None = None
    """Where every episode is also saved as verifiers saves an eval's (`traces.jsonl`, by its
    own writer; a subdirectory per runner process): the messages, rewards and errors verifiers
    saw. None: not saved. The ids and log-probs trained on are the gateway's, never these."""
