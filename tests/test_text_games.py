"""The text-game examples (examples/text_games/games.py) played through the environment seam
with scripted moves: Gymnasium's FrozenLake and TextArena's GuessTheNumber."""

from __future__ import annotations

import asyncio
import re
import sys
from collections import deque
from pathlib import Path

import pytest

from asyncrl.items import PromptItem

pytest.importorskip("gymnasium")
pytest.importorskip("textarena")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "text_games"))
import games


def _item(seed: int) -> PromptItem:
    record = games.make(train_size=seed + 1)["train"][seed]
    return PromptItem(prompt_id=f"s{seed}", prompt=record["prompt"], prompt_ids=[1], answer=seed)


def _cells(board: str, ch: str) -> list[tuple[int, int]]:
    rows = board.splitlines()[1:]
    return [(r, c) for r, row in enumerate(rows) for c, x in enumerate(row) if x == ch]


def _plan(board: str) -> list[str]:
    """Shortest moves from P to G avoiding holes, read off the board the model is shown."""
    rows = board.splitlines()[1:]
    start = _cells(board, "P")[0]
    steps = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    queue, seen = deque([(start, [])]), {start}
    while queue:
        (r, c), path = queue.popleft()
        if rows[r][c] == "G":
            return path
        for move, (dr, dc) in steps.items():
            nr, nc = r + dr, c + dc
            ok = 0 <= nr < len(rows) and 0 <= nc < len(rows[0]) and rows[nr][nc] != "H"
            if ok and (nr, nc) not in seen:
                seen.add((nr, nc))
                queue.append(((nr, nc), [*path, move]))
    raise AssertionError(f"no path on\n{board}")


def test_frozenlake_won_by_a_plan_lost_in_a_hole() -> None:
    async def play(seed: int, into_hole: bool) -> tuple[float | None, int]:
        env = games.FrozenLake()
        board = await env.reset(_item(seed))
        grid = board.split("\n", 1)[1]
        assert grid.count("P") == 1 and "G" in grid
        moves = _plan(board)
        if into_hole:  # walk the plan until a hole is next to P, then step into it
            rows = board.splitlines()[1:]
            holes = [(r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "H"]
            r, c = next(
                (r, c) for r, row in enumerate(rows) for c, ch in enumerate(row) if ch == "P"
            )
            hr, hc = holes[0]
            moves = (["down"] * (hr - r) if hr > r else ["up"] * (r - hr)) + (
                ["right"] * (hc - c) if hc > c else ["left"] * (c - hc)
            )
        # A reply without a move is asked again; the board does not change.
        again = await env.step("I am thinking")
        assert again.done is False and "one move" in str(again.observation)
        turns = 0
        for move in moves:
            turns += 1
            result = await env.step(f"I go {move}.")
            if result.done:
                await env.close()
                return result.reward, turns
        await env.close()
        return None, turns

    reward, turns = asyncio.run(play(3, into_hole=False))
    assert reward == 1.0 and turns >= 2
    reward, _ = asyncio.run(play(3, into_hole=True))
    assert reward == 0.0


def test_guess_the_number_binary_search_wins() -> None:
    async def play(seed: int) -> tuple[float | None, list[str]]:
        env = games.TextArenaGame("GuessTheNumber-v0")
        shown = [await env.reset(_item(seed))]
        low, high = 1, 20
        for _ in range(10):
            guess = (low + high) // 2
            result = await env.step(f"My guess is [{guess}]")
            if result.done:
                return result.reward, shown
            text = str(result.observation)
            shown.append(text)
            if re.search(r"higher", text, re.I):
                low = guess + 1
            elif re.search(r"lower", text, re.I):
                high = guess - 1
        return None, shown

    reward, shown = asyncio.run(play(5))
    assert reward == 1.0
    assert "Guess The Number" in shown[0]
    # Each turn shows only what is new: the rules are not repeated.
    assert all("Guess The Number" not in text for text in shown[1:]), shown
