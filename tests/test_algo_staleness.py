"""The staleness math of `asyncrl.algo.staleness` and the trainer's length-bias figures, on
hand-worked values. The KS values are those scipy's `ks_2samp(a, b).statistic` gives (scipy
1.17.1, computed once; scipy is not a dependency)."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.algo.config import AlgoConfig
from asyncrl.algo.staleness import episode_turns, ks_statistic, token_lag_keep
from asyncrl.protocol import Sample
from asyncrl.trainer import length_bias
from asyncrl.trainer.batch import group_rows
from asyncrl.trainer.length_bias import LengthBias, group_length, lag_masked_fraction

from sample_groups import group_of

SCIPY_KS = [
    ([1, 2, 3, 4], [1, 2, 3, 4], 0.0),
    ([1, 2, 3, 4], [1, 2], 0.5),
    ([1, 2, 3, 4, 10, 12], [1, 2, 3, 4], 1 / 3),
    ([1, 1, 2, 5], [2, 3], 0.5),
    ([0.5, 3.0, 7.0], [1.0, 2.0, 4.0, 8.0, 9.0], 0.4),
]


@pytest.mark.parametrize(("a", "b", "expected"), SCIPY_KS)
def test_ks_statistic_matches_scipy(a: list[float], b: list[float], expected: float) -> None:
    assert ks_statistic(a, b) == pytest.approx(expected)
    assert ks_statistic(b, a) == pytest.approx(expected)


def test_ks_statistic_of_an_empty_side_is_zero() -> None:
    assert ks_statistic([], [1.0, 2.0]) == 0.0


def test_token_lag_keep() -> None:
    # Lags 4, 4, 2, 1 at version 7.
    keep = token_lag_keep(np.array([3, 3, 5, 6], np.int32), 7, 2)
    assert keep.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert token_lag_keep(np.array([7, 7]), 7, 0).tolist() == [1.0, 1.0]


def test_episode_turns_counts_runs_of_trained_tokens() -> None:
    assert episode_turns(np.array([1, 1, 0, 0, 1, 0, 1], np.uint8)) == 3
    assert episode_turns(np.array([0, 1, 1], np.uint8)) == 1
    assert episode_turns(np.array([0, 0], np.uint8)) == 0
    assert episode_turns(None) == 1


def sample(versions: list[int], mask: list[int] | None = None, reward: float = 1.0) -> Sample:
    n = len(versions)
    return Sample(
        response_ids=np.full(n, 4, np.int32),
        logprobs=np.full(n, -0.5, np.float32),
        versions=np.array(versions, np.int32),
        reward=reward,
        finish="stop",
        loss_mask=None if mask is None else np.array(mask, np.uint8),
    )


def test_old_tokens_leave_the_loss_but_the_group_stays() -> None:
    # A 2-turn episode: turn 1 at version 2, an observation, turn 2 at version 6; its sibling
    # one turn at version 6. At version 7 with a limit of 2, turn 1 (lag 5) leaves the loss.
    long = sample([2, 2, 2, 2, 6, 6], [1, 1, 0, 0, 1, 1], reward=1.0)
    short = sample([6, 6], reward=0.0)
    group = group_of([long, short])
    algo = AlgoConfig()
    rows = group_rows([group], algo, 16, token_lag=(7, 2))
    assert rows[0].loss_mask.tolist() == [0, 0, 0, 0, 1, 1]
    assert rows[1].loss_mask.tolist() == [1, 1]
    # The advantages are those of both rewards: the group is whole.
    unmasked = group_rows([group], algo, 16)
    assert [r.advantage for r in rows] == [r.advantage for r in unmasked]
    assert rows[0].advantage > 0 > rows[1].advantage
    # 2 of the 6 trained tokens are older than the limit.
    assert lag_masked_fraction([group], 7, 2) == pytest.approx(2 / 6)
    assert lag_masked_fraction([group], 7, 5) == 0.0


def test_the_default_token_lag_limit_is_twice_eta() -> None:
    assert AlgoConfig().token_lag_limit(4) == 8
    assert AlgoConfig().token_lag_limit(0) == 0  # sync mode: every token is current
    assert AlgoConfig(max_token_lag=3).token_lag_limit(4) == 3


def test_group_length_is_its_longest_episode() -> None:
    group = group_of(
        [sample([0] * 7, [1, 1, 0, 1, 0, 0, 1]), sample([0] * 3)], created_at=10.0, finished_at=14.5
    )
    assert group_length(group) == (3, 7, 4.5)


def timed(tokens: int, seconds: float) -> object:
    return group_of([sample([0] * tokens)], created_at=0.0, finished_at=seconds)


def test_length_bias_is_zero_when_every_group_is_trained_and_not_when_long_ones_drop() -> None:
    short = [timed(2, 1.0), timed(3, 1.5)]
    long = [timed(20, 30.0)]
    kept = LengthBias()
    figures = kept.step([*short, *long], [])  # type: ignore[list-item]
    assert figures["length_bias_ks"] == 0.0
    assert figures["episode_tokens_generated"] == figures["episode_tokens_trained"] == 25 / 3

    dropped = LengthBias()
    figures = dropped.step(short, long)  # type: ignore[arg-type]
    # Generated {2, 3, 20}, trained {2, 3}: at 3 tokens F = 2/3 against 1.
    assert figures["length_bias_ks"] == pytest.approx(1 / 3)
    assert figures["episode_tokens_trained"] == 2.5
    assert figures["episode_seconds_generated"] == pytest.approx(32.5 / 3)
    # Over the run: a second step that drops nothing keeps the first step's bias in the figure.
    # Generated {2, 3, 20, 2, 3}, trained {2, 3, 2, 3}: at 3 tokens F = 4/5 against 1.
    again = dropped.step(short, [])  # type: ignore[arg-type]
    assert again["length_bias_ks"] == pytest.approx(1 / 5)


def test_length_bias_looks_back_a_window_of_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(length_bias, "WINDOW_STEPS", 2)
    bias = LengthBias()
    short, long = [timed(2, 1.0)], [timed(20, 30.0)]
    assert bias.step(short, long)["length_bias_ks"] == pytest.approx(1 / 2)  # type: ignore[arg-type]
    assert bias.step(short, [])["length_bias_ks"] == pytest.approx(1 / 3)  # type: ignore[arg-type]
    # The dropping step has left the window.
    assert bias.step(short, [])["length_bias_ks"] == 0.0  # type: ignore[arg-type]
