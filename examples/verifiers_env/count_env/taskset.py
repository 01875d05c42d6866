"""A small multi-turn verifiers 0.4 environment: the model is asked for a short word, then asked
twice more to say it again, each time as a new user turn of the same conversation. The rubric
rewards replies made of the letter `a`: a reward a random tiny model earns sometimes, so there
is something to learn, and one computed from the trace alone, so anyone can rescore it.
"""

import verifiers.v1 as vf
from pydantic import Field


class CountData(vf.TaskData):
    """One task: the opening prompt (`prompt`) and the follow-up user turns."""

    followups: list[str] = Field(default_factory=list)


class CountTask(vf.Task[CountData]):
    @vf.reward(weight=1.0)
    async def a_share(self, trace: vf.Trace) -> float:
        """The share of `a` among the characters of the assistant's replies (0 for none)."""
        text = "".join(
            node.message.content or ""
            for node in trace.nodes
            if node.sampled and isinstance(node.message.content, str)
        )
        return text.count("a") / len(text) if text else 0.0


class CountConfig(vf.TasksetConfig):
    num_tasks: int = 24
    """How many tasks to build."""
    turns: int = 3
    """User turns per episode (the opening prompt included)."""


class CountTaskset(vf.Taskset[CountTask, CountConfig]):
    def load(self) -> list[CountTask]:
        words = ["a", "aa", "ab", "ba", "aaa", "bab"]
        return [
            CountTask(
                CountData(
                    id=f"count-{i}",
                    prompt=f"say {words[i % len(words)]}",
                    followups=["again"] * (self.config.turns - 1),
                ),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


class CountEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class CountEnv(vf.Env[CountEnvConfig]):
    """The conversation: the task's prompt, then each follow-up as a new user turn."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()
            for followup in task.data.followups:
                if reply.terminated:
                    break
                reply = await chat.turn(followup)
