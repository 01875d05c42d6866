"""Text games as asyncrl environments: Gymnasium's FrozenLake and any single-player TextArena
game, each in a few lines of glue over the environment seam (`asyncrl.environments`).

Each record's answer is the game's seed, so an episode replays the same game on every worker
and the held-out split holds other games. The prompt says how to play; `reset` shows the first
state, every `step` takes the model's move and shows what it did; the game's reward ends the
episode. Observations are plain text, rendered as user turns by the chat template and
loss-masked. Configs: `frozenlake.yaml`, `guess_the_number.yaml` (need an instruct chat model;
`pip install 'asyncrl[games]'`).
"""

from __future__ import annotations

import re
from typing import Any

from asyncrl.environments import StepResult

MOVES = {"left": 0, "down": 1, "right": 2, "up": 3}  # FrozenLake's action ids


def make(game: str = "frozenlake", train_size: int = 1000, eval_size: int = 50) -> dict[str, Any]:
    """Records `{prompt, answer: seed}`: train seeds 0.., held-out seeds after them."""
    rules = {
        "frozenlake": "Walk from S to G on the frozen lake without stepping into a hole (H). "
        "Each turn, answer with one move: left, down, right or up.",
        "textarena": "Play the game below. Each turn, answer with your move as the game asks.",
    }[game]

    def records(seeds: range) -> list[dict[str, Any]]:
        return [{"prompt": rules, "answer": seed} for seed in seeds]

    return {
        "train": records(range(train_size)),
        "eval": records(range(train_size, train_size + eval_size)),
    }


class FrozenLake:
    """Gymnasium's FrozenLake-v1 on a random 4×4 map per seed, not slippery (so a right plan
    always wins), at most `max_moves` moves. Reward 1 for reaching the goal, else 0."""

    def __init__(self, size: int = 4, max_moves: int = 12) -> None:
        self._size = size
        self._max_moves = max_moves
        self._env: Any = None
        self._moves = 0

    async def reset(self, item: Any) -> str:
        import gymnasium as gym
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        seed = int(item.answer)
        desc = generate_random_map(size=self._size, seed=seed)
        self._env = gym.make("FrozenLake-v1", desc=desc, is_slippery=False)
        state, _ = self._env.reset(seed=seed)
        self._moves = 0
        return self._board(state)

    async def step(self, response: str) -> StepResult:
        words = re.findall(r"left|down|right|up", response.lower())
        if not words:
            return StepResult("Answer with one move: left, down, right or up.", done=False)
        state, reward, terminated, truncated, _ = self._env.step(MOVES[words[-1]])
        self._moves += 1
        if terminated or truncated or self._moves >= self._max_moves:
            return StepResult(None, done=True, reward=float(reward))
        return StepResult(self._board(state), done=False)

    async def close(self) -> None:
        if self._env is not None:
            self._env.close()

    def _board(self, state: int) -> str:
        rows = [[c.decode() for c in row] for row in self._env.unwrapped.desc]
        rows[state // self._size][state % self._size] = "P"
        return "You are P.\n" + "\n".join("".join(row) for row in rows)


class TextArenaGame:
    """A single-player TextArena game (`env_id`, e.g. GuessTheNumber-v0). TextArena's
    observations are the whole history so far: each turn shows only what is new. Reward: the
    player's reward when the game ends (1 for a win)."""

    def __init__(self, env_id: str = "GuessTheNumber-v0") -> None:
        self._env_id = env_id
        self._env: Any = None
        self._seen = 0

    async def reset(self, item: Any) -> str:
        import textarena as ta

        self._env = ta.make(self._env_id)
        self._env.reset(num_players=1, seed=int(item.answer))
        return self._new()

    async def step(self, response: str) -> StepResult:
        done, _ = self._env.step(response)
        if done:
            rewards, _ = self._env.close()
            self._env = None
            return StepResult(None, done=True, reward=float(rewards[0]))
        return StepResult(self._new(), done=False)

    async def close(self) -> None:
        if self._env is not None:
            self._env.close()

    def _new(self) -> str:
        _, history = self._env.get_observation()
        new, self._seen = history[self._seen :], len(history)
        return new.strip()
