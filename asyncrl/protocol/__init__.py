"""Wire format of the `prompts` and `trajectories` streams (msgpack; trajectory groups in schema
2, the bulk layout, with schema 1 still read; prompts in schema 1).

Every message is a msgpack map with string keys, so any msgpack library in any language can read
it. Arrays travel as msgpack `bin` holding raw little-endian values (int32, float32 or uint8) and
are decoded with `np.frombuffer`: the decoded arrays are read-only views of the bytes that msgpack
unpacked, and keep dtype `<i4`/`<f4` (native on little-endian hosts; still correct, only slower,
on big-endian ones).

Reading is the trust boundary: `decode_group` and `decode_prompt` reject anything oversize,
malformed or semantically wrong with a `ValidationError` (and nothing else), so one bad stream entry
is dead-lettered instead of taking down a worker. A decoded object has always passed validation.
Keys that a schema does not know are ignored, so optional fields can be added without a new one.

The modules: `records` (the messages, `Limits`, `ValidationError`), `validate` (the checks),
`wire` (encode and decode) and `batch` (decoding a read's entries at once). The package imports
only numpy and msgpack: rollout workers, the queue and `asyncrl status` use it without loading
torch.
"""

from __future__ import annotations

from asyncrl.protocol.batch import decode_groups
from asyncrl.protocol.records import (
    DEFAULT_LIMITS,
    FINISH_CODES,
    FINISH_REASONS,
    PROMPT_SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSIONS,
    Finish,
    Limits,
    MetaValue,
    PromptGroup,
    Reason,
    Sample,
    TrajectoryGroup,
    ValidationError,
)
from asyncrl.protocol.validate import validate_group, validate_prompt
from asyncrl.protocol.wire import (
    decode_group,
    decode_prompt,
    encode_group,
    encode_prompt,
    plain_value_problem,
    stream_fields,
)

__all__ = [
    "DEFAULT_LIMITS",
    "FINISH_CODES",
    "FINISH_REASONS",
    "PROMPT_SCHEMA",
    "SCHEMA_VERSION",
    "SCHEMA_VERSIONS",
    "Finish",
    "Limits",
    "MetaValue",
    "PromptGroup",
    "Reason",
    "Sample",
    "TrajectoryGroup",
    "ValidationError",
    "decode_group",
    "decode_groups",
    "decode_prompt",
    "encode_group",
    "encode_prompt",
    "plain_value_problem",
    "stream_fields",
    "validate_group",
    "validate_prompt",
]
