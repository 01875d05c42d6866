"""The chaos soak of tools/chaos.py, shortened for CI: ≥ 20 faults of every kind (rollout
workers SIGKILLed and restarted or frozen past their heartbeat and resumed, the trainer and Redis
SIGKILLed and restarted, Redis restarted empty and held at its memory limit, hostile entries) on
multi-turn episodes spanning several versions under the default `algo.stale_policy: train`, in
about two minutes, then the run's invariants (DESIGN §9). The longer soak and its figures (both
policies) are in docs/reliability.md.

One run feeds the slow tests of this module; each asserts one family of the tool's checks. The
others check the tool's accounting on histories written by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncrl.runstate import Counter, Counters, Keys

from chaos import RUN_ID, G, Segment, account, run_chaos

FAULTS = 20
# Redis restarts and hostile entries are the cheapest faults (no process re-imports torch),
# trainer restarts the dearest: this deck gets 20 mixed faults into the time budget.
DECK = {
    "worker": 3,
    "redis": 2,
    "trainer": 1,
    "redis_empty": 1,
    "redis_full": 1,
    "hostile": 1,
    "freeze": 1,
}
KEYS = Keys(RUN_ID)


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory, random_model: Path) -> dict[str, Any]:
    return run_chaos(
        # The run ends after FAULTS faults; `seconds` only caps a run that stalls.
        seconds=400,
        workers=3,
        seed=0,
        workdir=tmp_path_factory.mktemp("chaos"),
        model=random_model,
        max_faults=FAULTS,
        deck=DECK,
        # The file store, not broadcast: after a worker dies, re-forming a broadcast group waits
        # out weights.sync_timeout_s, which would take most of the CI budget (the soak uses it).
        weights="store",
        # Multi-turn: episodes outlive versions and go on with new weights, workers die
        # mid-episode, and a frozen worker wakes between turns of episodes taken over.
        task="agentic",
        progress_timeout_s=60,
    )


def failed(summary: dict[str, Any], *checks: str) -> list[str]:
    return [f"[{v['check']}] {v['message']}" for v in summary["violations"] if v["check"] in checks]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_accounting_balances_and_nothing_is_lost(summary: dict[str, Any]) -> None:
    assert not failed(summary, "balanced", "nothing_lost", "dead_letters"), summary
    assert summary["balanced"] and summary["lost"] == 0
    assert summary["counters"][Counter.GROUPS_TRAINED] > 0


@pytest.mark.slow
def test_no_group_is_trained_twice(summary: dict[str, Any]) -> None:
    # summary["killed_before_ack"] lists the riskiest trainer kills, if this fails.
    assert not failed(summary, "no_double_training"), summary
    assert summary["counters"][Counter.GROUPS_TRAINED] == summary["final_step"] * G


@pytest.mark.slow
def test_progress_after_every_fault_and_nothing_dropped_stale(summary: dict[str, Any]) -> None:
    assert not failed(summary, "progress", "drain", "staleness"), summary
    assert all(f["recovered_after_s"] is not None for f in summary["fault_log"])
    assert summary["stale_policy"] == "train"
    ended = summary["ended"]
    assert ended["dropped_stale_by_trainer"] == ended["dropped_stale_by_workers"] == 0, ended
    # Every way a group ends, summed, is every group released.
    assert sum(ended.values()) == summary["counters"][Counter.PROMPTS_RELEASED], ended


@pytest.mark.slow
def test_admission_bounds_the_queue(summary: dict[str, Any]) -> None:
    assert not failed(summary, "admission"), summary
    assert summary["max_queued"] <= summary["queued_bound"]


@pytest.mark.slow
def test_faults_were_many_and_mixed(summary: dict[str, Any]) -> None:
    faults = summary["faults"]
    assert set(faults) == set(DECK), faults
    assert sum(faults.values()) >= FAULTS, faults


@pytest.mark.slow
def test_every_role_survives_redis_restarts(summary: dict[str, Any]) -> None:
    assert not failed(summary, "roles_survive"), summary["exits"]


@pytest.mark.slow
def test_hostile_entries_are_rejected_never_trained(summary: dict[str, Any]) -> None:
    assert not failed(summary, "hostile"), summary
    assert {"unreleased", "response_out_of_vocab", "junk"} <= set(summary["hostile_entries"])


@pytest.mark.slow
def test_versions_are_never_reused(summary: dict[str, Any]) -> None:
    assert not failed(summary, "versions"), summary
    assert summary["redis_lost_data"] >= 1 and not summary["versions_reused"]


@pytest.mark.slow
def test_a_frozen_worker_loses_its_prompts_to_the_others(summary: dict[str, Any]) -> None:
    # Nothing trained twice or lost after it woke: the tests above.
    assert not failed(summary, "takeover"), summary
    frozen = [f for f in summary["fault_log"] if f["kind"] == "freeze"]
    assert frozen and all(f["taken_over"] == f["held"] for f in frozen), frozen
    assert sum(f["held"] for f in frozen) > 0, frozen


def segment(counters: Counters, prompts: int, published: int, dead: int, queued: int) -> Segment:
    """A history of `prompts` released prompt entries p0, p1, …: the first `published` answered
    by a trajectory entry each (all acked), the next `dead` dead-lettered, the next `queued`
    still queued, and the rest acked with no trace."""
    ids = [f"{i}-0" for i in range(prompts)]
    return Segment(
        counters=counters,
        streams={},
        in_flight=queued,
        prompts=ids,
        trajectories={f"{i}-1": ids[i] for i in range(published)},
        dlq=[(KEYS.prompts, i, "max_deliveries") for i in ids[published : published + dead]],
        queued={(KEYS.prompts, i) for i in ids[published + dead : published + dead + queued]},
    )


def test_groups_a_worker_gave_up_as_stale_are_accounted_not_lost() -> None:
    # 5 prompts: 2 trained, 1 dead-lettered, 1 in flight, 1 dropped stale by its worker (acked
    # with no trajectory entry and no dead letter, counted).
    counters = Counters(
        prompts_released=5,
        groups_published=2,
        groups_trained=2,
        groups_dropped_stale=1,
        groups_dead_lettered=1,
    )
    ledger = account([segment(counters, 5, 2, 1, 1)], {}, KEYS)
    assert ledger.violations == [] and ledger.lost == 0
    assert ledger.ended(counters)["dropped_stale_by_workers"] == 1
    assert ledger.ended(counters)["dropped_stale_by_trainer"] == 0
    # Every way the 5 groups ended: 2 trained, 1 given up, 1 dead-lettered, 1 in flight.
    assert sum(ledger.ended(counters, in_flight=1).values()) == 5


def test_a_prompt_acked_with_no_outcome_counted_is_lost() -> None:
    counters = Counters(prompts_released=5, groups_published=2, groups_trained=2)
    ledger = account([segment(counters, 5, 2, 1, 1)], {}, KEYS)
    assert ledger.lost == 2  # the dead letter is not counted either
    assert [check for check, _ in ledger.violations] == ["nothing_lost"]


def test_after_redis_lost_its_data_untraced_prompts_must_fit_the_counted_drops() -> None:
    before = segment(Counters(prompts_released=2, groups_published=2, groups_trained=2), 2, 2, 0, 0)
    # Seeded again after the loss: the counters carry the earlier segment's figures.
    after = Counters(prompts_released=6, groups_trained=2, groups_dropped_stale=1)
    assert account([before, segment(after, 4, 0, 0, 3)], {}, KEYS).violations == []
    ledger = account([before, segment(after, 4, 0, 0, 2)], {}, KEYS)
    assert ledger.lost == 1 and ledger.violations[0][0] == "nothing_lost"
