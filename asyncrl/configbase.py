"""The base class every config section derives from.

Sections are pydantic models owned by the component they configure; `asyncrl.config` assembles
them into one tree. They must import without torch or any engine so that `asyncrl --help` and
config validation stay fast.
"""

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict


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
