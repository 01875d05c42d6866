"""Config of the gateway (`rollout.gateway`): the endpoint a rollout worker serves its agents'
calls on. Nothing here imports torch or an HTTP client."""

from pydantic import Field

from asyncrl.configbase import Section


class GatewayConfig(Section):
    """The OpenAI-compatible endpoint a rollout worker serves its agents' calls on
    (`asyncrl.gateway`); every call needs a live episode's credentials."""

    host: str = "127.0.0.1"
    """Address it binds; loopback by default, where the agents run in the worker's process."""

    port: int = Field(default=0, ge=0, lt=1 << 16)
    """Port it binds; 0: a free one (each worker of a host gets its own)."""

    advertise_host: str | None = None
    """Host the episodes' base URLs name, for agents elsewhere (`task.agent.type: remote`):
    the worker's address as the runners reach it (a pod IP, a service name). None: `host`
    (loopback for `0.0.0.0`)."""
