"""One real run whose bottleneck is known: `asyncrl launch --role all` of 2-turn agentic episodes
behind a 0.3 s tool, one rollout worker, a tiny model — environment-bound. Its records carry the
time breakdown of both roles (fractions summing to 1), `asyncrl doctor` names the environment,
and the `profile` config key left a Chrome trace of the trainer's step 2."""

from __future__ import annotations

import json
import math

import pytest

from asyncrl.doctor import from_run_dir
from asyncrl.metrics.breakdown import ROLLOUT_PHASES, TRAINER_PHASES
from asyncrl.reasons import Bottleneck

from role_procs import Launched, Run, asyncrl

pytestmark = pytest.mark.timeout(600)
STEPS = 4


@pytest.fixture(scope="module")
def slow_tool_run(launched: Launched) -> Run:
    return launched(
        "doctor-env",
        "task.type=agentic",
        "task.turns=2",
        "task.tool_latency_median_s=0.3",
        "task.tool_latency_sigma=0",
        f"trainer.max_steps={STEPS}",
        "trainer.groups_per_step=4",
        "rollout.n=2",
        "rollout.prompts_per_batch=4",
        "metrics.breakdown_every_s=1",
        "profile.role=trainer",
        "profile.steps=[2]",
    )


def test_a_slow_tool_run_is_diagnosed_environment_bound(slow_tool_run: Run) -> None:
    run = slow_tool_run
    assert len(run.steps) == STEPS
    for line in run.steps:
        fractions = [line[f"time_{p}"] for p in TRAINER_PHASES]
        assert math.isclose(sum(fractions), 1.0, abs_tol=1e-9), line
        assert line["breakdown_seconds"] > 0
    workers = [json.loads(x) for x in (run.dir / "rollout.jsonl").read_text().splitlines()]
    assert workers and all(
        math.isclose(sum(w[f"time_{p}"] for p in ROLLOUT_PHASES), 1.0, abs_tol=1e-9)
        for w in workers
    )
    assert sum(w["groups"] for w in workers) >= STEPS * 4

    diagnosis, _ = from_run_dir(run.dir)
    assert diagnosis.bottleneck is Bottleneck.ENVIRONMENT, diagnosis.render("")
    assert diagnosis.rollout is not None and diagnosis.rollout.fractions["env"] > 0.5
    doctor = asyncrl("doctor", str(run.dir))
    assert doctor.returncode == 0, doctor.stderr
    assert "Bottleneck: environment" in doctor.stdout
    # Every worker had stopped when status ran: its verdict reads the trainer's last step.
    assert run.status["doctor"]["headline"].startswith("the trainer waited")

    (trace,) = (run.dir / "profile").iterdir()
    assert trace.name.endswith("-step2.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" and e["name"].endswith(" step 2") for e in events)
