"""Config of the tool environment (`asyncrl.environments.tools`). Nothing here imports torch:
tool modules are imported when the config loads, their schemas are built when the role starts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from asyncrl.configbase import Section
from asyncrl.tasks.config import RewardConfig


class ToolEnvironmentConfig(Section):
    """Episodes in which the policy calls tools: each turn's `<tool_call>{json}</tool_call>`
    blocks are run and their results come back as `tool` chat messages; a turn without a call
    is the final answer."""

    type: Literal["tools"] = "tools"
    """Environment backend."""

    python_path: list[str] = Field(default_factory=list)
    """Directories put first on `sys.path` before the tools are imported (relative ones against
    the working directory)."""

    tools: list[str] = Field(min_length=1)
    """The tools, each "package.module:function" (sync or `async def`). A tool's name is its
    function's name; its JSON schema comes from the type hints and the docstring's `Args:`
    section (transformers' `get_json_schema`), and is rendered into the prompt through the chat
    template's `tools=` argument."""

    timeout_s: float = Field(default=10.0, gt=0)
    """Seconds one tool call may take; past that the model is told it timed out
    (`tool_timeout`). A sync tool runs on a thread, which goes on to its end unseen."""

    max_turns: int = Field(default=8, ge=1)
    """Policy turns per episode; the episode ends after this many even if the last one called
    tools (then scored like a final answer)."""

    max_calls_per_turn: int = Field(default=8, ge=1)
    """Tool calls run per turn; the model is told the others were not (`too_many_calls`)."""

    max_result_chars: int = Field(default=8192, ge=1)
    """A tool result longer than this is cut to it, so one tool cannot flood the context."""

    system_prompt: str | None = None
    """A system message put before the prompt; None: the chat template's default."""

    reward: RewardConfig | None = None
    """How the final answer is scored; None: by the task's reward."""

    @field_validator("python_path")
    @classmethod
    def _absolute(cls, dirs: list[str]) -> list[str]:
        from asyncrl.tasks.plugins import absolute_dirs

        return absolute_dirs(dirs)

    @field_validator("tools")
    @classmethod
    def _resolve(cls, paths: list[str], info: ValidationInfo) -> list[str]:
        from asyncrl.tasks.plugins import load_object

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
