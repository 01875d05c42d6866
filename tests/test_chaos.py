"""The chaos soak of tools/chaos.py, shortened for CI: ≥ 20 faults of every kind (rollout
workers, the trainer and Redis SIGKILLed and restarted, Redis restarted empty and held at its
memory limit, hostile entries) in about two minutes, then the run's invariants (DESIGN §9). The
longer soak and its figures are in docs/reliability.md.

One run feeds all the tests of this module; each asserts one family of the tool's checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncrl.runstate import Counter

from chaos import G, run_chaos

FAULTS = 20
# Redis restarts and hostile entries are the cheapest faults (no process re-imports torch),
# trainer restarts the dearest: this deck gets 20 mixed faults into the time budget.
DECK = {"worker": 3, "redis": 2, "trainer": 1, "redis_empty": 1, "redis_full": 1, "hostile": 1}


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory, random_model: Path) -> dict[str, Any]:
    return run_chaos(
        seconds=100,
        workers=3,
        seed=0,
        workdir=tmp_path_factory.mktemp("chaos"),
        model=random_model,
        max_faults=FAULTS,
        deck=DECK,
        # The file store, not broadcast: after a worker dies, re-forming a broadcast group waits
        # out weights.sync_timeout_s, which would take most of the CI budget (the soak uses it).
        weights="store",
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
def test_progress_after_every_fault_and_staleness_bounded(summary: dict[str, Any]) -> None:
    assert not failed(summary, "progress", "drain", "staleness"), summary
    assert all(f["recovered_after_s"] is not None for f in summary["fault_log"])
    assert summary["max_staleness"] <= summary["max_staleness_bound"]


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
