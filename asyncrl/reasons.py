"""Why a call failed and what became of it: the stable codes that metric labels, dead-letter
reasons and env-server replies are made of, spelled once.

Each is a `StrEnum`, so a member is its string (`EnvReason.TIMEOUT == "timeout"`) and goes
into JSON, msgpack, Redis and Prometheus labels unchanged; renaming a value renames a label
the dashboards read. The metric table (`asyncrl.metrics.table`) takes its label values from
here, so it needs none of the modules that raise them. Imports nothing of asyncrl.
"""

from enum import StrEnum


class EngineReason(StrEnum):
    """Why a generate call failed (`asyncrl.engines.base.EngineError.reason`); the group's
    dead-letter reason is `engine_{reason}`."""

    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    SERVER_ERROR = "server_error"
    """HTTP 5xx."""
    MALFORMED = "malformed"
    """A reply that does not fit the API."""
    REJECTED = "rejected"
    """HTTP 4xx."""
    ABORTED = "aborted"
    """The server aborted the request (e.g. paused with mode abort)."""
    NO_SERVER = "no_server"
    """None in rotation."""


class EnvReason(StrEnum):
    """Why an environment call failed (`asyncrl.environments.base.EnvironmentFailure.reason`,
    label of `asyncrl_environment_errors_total`; the group's dead-letter reason is
    `env_{reason}`)."""

    ERROR = "error"
    """Its code raised."""
    TIMEOUT = "timeout"
    """It outlived its timeout."""
    MALFORMED = "malformed"
    """Its reply does not fit the protocol."""
    UNAVAILABLE = "unavailable"
    """No server could take or keep the episode."""


ENV_REASONS: tuple[str, ...] = tuple(EnvReason)
"""`EnvReason`'s values, to test a string read from the wire: `in` on the enum class itself
takes members only (Python 3.11)."""


class GroupReason(StrEnum):
    """Why the rollout side gave a prompt's group up: every `FailedGroup.reason`
    (`asyncrl.rollout.scheduler`) but `stale` (counted by
    `asyncrl_rollout_groups_dropped_stale_total`); the label of
    `asyncrl_rollout_groups_failed_total` and the group's dead-letter reason. Each
    `EngineReason` and `EnvReason` has its member here (`tests/test_metrics.py`)."""

    ENGINE_TIMEOUT = "engine_timeout"
    ENGINE_UNREACHABLE = "engine_unreachable"
    ENGINE_SERVER_ERROR = "engine_server_error"
    ENGINE_MALFORMED = "engine_malformed"
    ENGINE_REJECTED = "engine_rejected"
    ENGINE_ABORTED = "engine_aborted"
    ENGINE_NO_SERVER = "engine_no_server"
    ENGINE_ERROR = "engine_error"
    """Any other failure of a generate call."""
    TASK_ERROR = "task_error"
    """The task's own code failed (its environment constructor, score or reward)."""
    REWARD_ERROR = "reward_error"
    """A `reward.type: python` call raised (or its process died)."""
    REWARD_TIMEOUT = "reward_timeout"
    """A `reward.type: python` call outlived its `timeout_s`."""
    REWARD_INVALID = "reward_invalid"
    """A `reward.type: python` call returned no finite number."""
    CONTEXT_TOO_LONG = "context_too_long"
    """An episode's first turn (prompt, first observation, `max_new_tokens`) would pass the
    scheduler's `max_context`."""
    ENV_ERROR = "env_error"
    ENV_TIMEOUT = "env_timeout"
    ENV_MALFORMED = "env_malformed"
    ENV_UNAVAILABLE = "env_unavailable"
    AGENT_ERROR = "agent_error"
    """A `task.agent` function raised (any BaseException), or returned what is no reward."""
    AGENT_TIMEOUT = "agent_timeout"
    """An agent outlived its `timeout_s`."""
    AGENT_UNAVAILABLE = "agent_unavailable"
    """No agent runner took the episode (`task.agent.type: remote`: all refused or
    unreachable), or the one running it went away mid-episode."""
    AGENT_NO_CALLS = "agent_no_calls"
    """An agent returned without one call through its gateway session: nothing to train."""
    AGENT_OVER_BUDGET = "agent_over_budget"
    """An agent's call past its episode's `max_calls` or `max_tokens`."""
    AGENT_CONTEXT_TOO_LONG = "agent_context_too_long"
    """An agent's call whose prompt leaves no room for a token within the context bound."""
    OTHER = "other"
    """A reason added elsewhere and not listed here, so that counting never fails a worker."""


class ToolCallOutcome(StrEnum):
    """What became of one tool call (`asyncrl.environments.tools`; label of
    `asyncrl_tool_calls_total`): it ran and returned, or why it did not."""

    OK = "ok"
    MALFORMED_JSON = "malformed_json"
    BAD_CALL = "bad_call"
    """Not an object with a string `name`."""
    UNCLOSED_CALL = "unclosed_call"
    """No `</tool_call>` (e.g. cut by the token limit)."""
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    TOO_MANY_CALLS = "too_many_calls"
    TOOL_ERROR = "tool_error"
    """It raised (`sys.exit()` included), or returned what JSON cannot write."""
    TOOL_TIMEOUT = "tool_timeout"
    TOOL_BUSY = "tool_busy"
    """A sync tool whose threads are all held by calls that have not returned."""


TOOL_CALL_OUTCOMES: tuple[str, ...] = tuple(ToolCallOutcome)
"""`ToolCallOutcome`'s values, to test a string a served environment reported."""


class DropReason(StrEnum):
    """Why the trainer dropped trajectories (label of `asyncrl_trajectories_dropped_total`)."""

    STALE = "stale"
    ZERO_VARIANCE = "zero_variance"
    INVALID = "invalid"


class BreakCause(StrEnum):
    """Why a gateway call did not continue its session's sample and began a new one of the
    same episode (`asyncrl.gateway.transcript`): each segment is trained as its own sample."""

    HISTORY_EDITED = "history_edited"
    """An earlier message changed or is gone (an edit, a compaction, a truncation)."""
    REPLY_EDITED = "reply_edited"
    """The reply the gateway returned is missing or changed (beyond its reasoning and the
    spelling of its tool calls' arguments)."""
    TOOLS_CHANGED = "tools_changed"
    OPTIONS_CHANGED = "options_changed"
    """Other chat template options (e.g. `enable_thinking`)."""
    TEMPLATE = "template"
    """The template's rendering leaves no single place for the new turns after a reply."""
    CONCURRENT = "concurrent"
    """A call planned before the session's previous call was recorded (parallel calls)."""


class Bottleneck(StrEnum):
    """What limits a run, as `asyncrl doctor` names it (`asyncrl.doctor.Finding.kind`)."""

    GENERATION = "generation"
    """The trainer waits for trajectories while the rollout engines generate."""
    ENVIRONMENT = "environment"
    """The trainer waits while the rollout workers wait on environments, tools or rewards."""
    STALENESS = "staleness"
    """Both wait: the rollout workers hold prompts for weights (the staleness bound)."""
    TRAINER = "trainer"
    """The rollout workers wait for prompts while the trainer computes."""
    WEIGHT_SYNC = "weight_sync"
    """Publishing or swapping weights takes more than its share."""
    ALL_REDUCE = "all_reduce"
    """The trainer's gradient all-reduce takes more than its share."""
    CHECKPOINT = "checkpoint"
    """Writing checkpoints takes more than its share."""
