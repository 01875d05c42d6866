"""The base class every config section derives from, and the base of the sections that name
user code by import path (rewards, task factories, environment classes, tools).

Sections are pydantic models owned by the component they configure; `asyncrl.config` assembles
them into one tree. They must import without torch or any engine so that `asyncrl --help` and
config validation stay fast.
"""

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from asyncrl.plugins import absolute_dirs


class Section(BaseModel):
    """A config section: unknown keys are errors, assignments are validated, docs per field.
    No float may be infinite or NaN: `.inf` passes every `gt`/`le` bound and then fails far
    from the config (a timeout that overflows, a heartbeat that never expires, NaN weights)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        validate_assignment=True,
        use_attribute_docstrings=True,
        frozen=False,
    )


def type_or(default: str) -> Callable[[Any], str]:
    """A union discriminator that reads `type` and takes `default` where it is left out, so that
    e.g. `rollout.engine.device=npu` alone configures the default engine. Members are tagged with
    `Tag(their type)`."""

    def member(value: Any) -> str:
        if isinstance(value, dict):
            return str(value.get("type", default))
        return str(getattr(value, "type", default))

    return member


class PluginPath(Section):
    """Where user code is imported from."""

    type: str
    """Backend; each member narrows it to its tag (declared here so that it comes first)."""

    python_path: list[str] = Field(default_factory=list)
    """Directories put first on `sys.path` before the user's code is imported (relative ones
    against the working directory); the working directory itself is always on it."""

    @field_validator("python_path")
    @classmethod
    def _absolute(cls, dirs: list[str]) -> list[str]:
        return absolute_dirs(dirs)


class PluginConfig(PluginPath):
    """One function or class of user code by import path, called with `kwargs`. `python_path`
    and `kwargs` come before `path` because checking `path` needs them: each member checks
    its `path` (that it imports and takes the call) in a validator of its own."""

    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments it is called with (a reward: on every call; a task factory: once; an
    environment class: once per episode)."""

    path: str
    """"package.module:name", imported from `python_path`, the working directory and
    PYTHONPATH; checked when the config loads."""
