"""The experiment trackers (`asyncrl.metrics.trackers`), offline: W&B in offline mode (its run
log read back), TensorBoard event files read back with TensorBoard's own reader, a local MLflow
file store read back with MLflow's client; a tracker that fails is dropped with one warning
while the others go on; and a real local run feeds all three the records of its metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.metrics.config import (
    MlflowTrackerConfig,
    TensorboardTrackerConfig,
    TrackerConfig,
    WandbTrackerConfig,
)
from asyncrl.metrics.record import EvalRecord, Record, StepRecord
from asyncrl.metrics.trackers import RunInfo, TrackerFeed, missing_package

from role_procs import launch_all, wait_until

RECORDS: list[Record] = [
    StepRecord(step=1, version=1, reward_mean=0.25, loss=0.5, skipped_nonfinite=False),
    StepRecord(step=2, version=2, reward_mean=0.5, loss=0.25, skipped_nonfinite=False),
    EvalRecord(step=2, eval_accuracy=0.75, wall_seconds=3.0),
    StepRecord(step=3, version=3, reward_mean=1.0, loss=None, skipped_nonfinite=True),
]
# What each backend must hold after RECORDS: figure → [(step, value)]; a None figure is not
# logged, a boolean is 0/1.
EXPECTED = {
    "reward_mean": [(1, 0.25), (2, 0.5), (3, 1.0)],
    "loss": [(1, 0.5), (2, 0.25)],
    "skipped_nonfinite": [(1, 0.0), (2, 0.0), (3, 1.0)],
    "eval_accuracy": [(2, 0.75)],
}


def feed(configs: list[TrackerConfig], tmp_path: Path, records: list[Record] = RECORDS) -> None:
    trackers = TrackerFeed(configs, RunInfo("trk", tmp_path, {"run": {"id": "trk"}}))
    for record in records:
        trackers.log(record)
    trackers.close()


def wandb_history(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], Any]:
    """The history rows and the run record of the one offline W&B run under `run_dir`, once its
    transaction log holds the run's exit (wandb's own process may still be writing it when
    `finish` returns)."""
    records: list[Any] = []

    def finished() -> bool:
        records[:] = wandb_records(run_dir)
        return any(r.WhichOneof("record_type") == "exit" for r in records)

    wait_until(finished, 60, "the W&B run's exit record")
    history: dict[str, list[tuple[int, float]]] = {}
    run = None
    for record in records:
        if record.WhichOneof("record_type") == "run":
            run = record.run
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            for key, value in row.items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((row["_step"], value))
    return history, run


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of the one offline W&B run under `run_dir`, parsed from its transaction log
    (`run-*.wandb`: LevelDB log framing — 32 KiB blocks of chunks with a 7-byte header: crc,
    length, type — around W&B's protobuf `Record`s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data.startswith(b":W&B"), data[:7]
    chunks, buf, pos, block = [], b"", 7, 32 * 1024
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too short for a header: the block's padding
            pos += block - pos % block
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (n == 0 and kind == 0) or pos + 7 + n > len(data):  # the end, or still being written
            break
        buf += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last chunk of one
            chunks.append(buf)
            buf = b""
    records = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def test_wandb_offline_run_holds_every_figure(tmp_path: Path) -> None:
    feed([WandbTrackerConfig(type="wandb", mode="offline", project="asyncrl-test")], tmp_path)
    history, run = wandb_history(tmp_path)
    assert {k: history[k] for k in EXPECTED} == EXPECTED
    assert run.display_name == "trk" and run.project == "asyncrl-test"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["run"] == {"id": "trk"}


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {
        tag: [(e.step, pytest.approx(e.value)) for e in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def test_tensorboard_event_files_hold_every_figure(tmp_path: Path) -> None:
    feed([TensorboardTrackerConfig(type="tensorboard")], tmp_path)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert {k: scalars[k] for k in EXPECTED} == EXPECTED
    assert "step" not in scalars


def mlflow_history(uri: str, experiment: str = "asyncrl") -> tuple[Any, dict[str, Any]]:
    """The one run of `experiment` at `uri` and its metric histories."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    (run,) = client.search_runs([exp.experiment_id])
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
    return run, history


def test_mlflow_file_store_holds_every_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MLflow 3 refuses its file store unless told (it wants a database); a test has no server.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    feed([MlflowTrackerConfig(type="mlflow", tracking_uri=uri)], tmp_path)
    run, history = mlflow_history(uri)
    assert {k: sorted(history[k]) for k in EXPECTED} == EXPECTED
    assert run.info.run_name == "trk" and run.info.status == "FINISHED"


def test_a_failing_tracker_is_dropped_once_and_the_others_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One tracker cannot start (its directory is a file), one fails mid-run (its store is
    deleted under it); each is logged once, and the third still gets every record."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tmp_path / "not-a-dir").write_text("")
    store = tmp_path / "mlruns"
    configs: list[TrackerConfig] = [
        TensorboardTrackerConfig(type="tensorboard", dir=str(tmp_path / "not-a-dir" / "tb")),
        MlflowTrackerConfig(type="mlflow", tracking_uri=store.as_uri()),
        TensorboardTrackerConfig(type="tensorboard", dir=str(tmp_path / "good")),
    ]
    trackers = TrackerFeed(configs, RunInfo("trk", tmp_path, {}))
    with caplog.at_level(logging.WARNING, logger="asyncrl.metrics.trackers"):
        trackers.log(RECORDS[0])
        # Once MLflow holds the first record, its store goes away: renamed in one step, since
        # MLflow's thread may still be writing into it (a recursive delete then races it).
        wait_until(lambda: any(store.glob("*/*/metrics/reward_mean")), 60, "mlflow's first record")
        store.rename(tmp_path / "mlruns-gone")
        for record in RECORDS[1:]:
            trackers.log(record)
        trackers.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "metrics.trackers.0 (tensorboard) could not start" in warnings[0]
    assert "metrics.trackers.1 (mlflow) failed" in warnings[1]
    scalars = tensorboard_scalars(tmp_path / "good")
    assert {k: scalars[k] for k in EXPECTED} == EXPECTED


def test_tracker_config_errors_name_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.trackers\.0\.type: 'neptune' is not one"):
        load_config(None, ["metrics.trackers=[{type: neptune}]"])
    with pytest.raises(ConfigError, match=r"metrics\.trackers\.1\.mode"):
        load_config(None, ["metrics.trackers=[{type: tensorboard}, {type: wandb, mode: x}]"])
    cfg = load_config(None, ["metrics.trackers=[{type: tensorboard}, {type: wandb}]"])
    assert missing_package(cfg.metrics.trackers) is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    assert missing_package(cfg.metrics.trackers) == (
        "metrics.trackers.1.type: wandb needs the wandb package: pip install 'asyncrl[wandb]'"
    )


@pytest.mark.slow
def test_a_local_run_feeds_every_tracker_its_jsonl_records(
    tmp_path: Path, redis_server: Any, random_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trainer rank 0 of a real run: each tracker holds exactly the reward of every step line of
    metrics.jsonl and the accuracy of every eval line."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    trackers = (
        f"[{{type: tensorboard}}, {{type: wandb, mode: offline}}, "
        f"{{type: mlflow, tracking_uri: '{uri}'}}]"
    )
    run = launch_all(
        tmp_path / "run",
        redis_server.url,
        random_model,
        "trackers",
        "trainer.max_steps=4",
        "trainer.eval_every=2",
        "trainer.eval_size=4",
        f"metrics.trackers={trackers}",
    )
    assert run.rc == 0, run.output
    lines = [json.loads(x) for x in (run.dir / "metrics.jsonl").read_text().splitlines()]
    want = {
        "reward_mean": [(x["step"], x["reward_mean"]) for x in lines if "reward_mean" in x],
        "eval_accuracy": [(x["step"], x["eval_accuracy"]) for x in lines if "eval_accuracy" in x],
    }
    assert [s for s, _ in want["reward_mean"]] == [1, 2, 3, 4]
    assert [s for s, _ in want["eval_accuracy"]] == [2, 4]
    approx = {k: [(s, pytest.approx(v)) for s, v in pairs] for k, pairs in want.items()}
    tb = tensorboard_scalars(run.dir / "tensorboard")
    wb, _ = wandb_history(run.dir)
    _, ml = mlflow_history(uri)
    for name, got in (("tensorboard", tb), ("wandb", wb), ("mlflow", ml)):
        assert {k: sorted(got[k]) for k in want} == approx, name
