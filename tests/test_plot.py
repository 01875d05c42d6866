import struct
from pathlib import Path

import pytest

from asyncrl.metrics.breakdown import ROLLOUT_PHASES, TRAINER_PHASES, TimeSplit
from asyncrl.metrics.jsonl import JsonlWriter
from asyncrl.metrics.record import ROLLOUT_LOG, WorkerRecord
from asyncrl.plot import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def write_run(run_dir: Path, steps: int = 30) -> None:
    with JsonlWriter(run_dir / "metrics.jsonl") as w:
        for step in range(1, steps + 1):
            line = {
                "step": step,
                "version": step,
                "wall_seconds": 2.0 * step,
                "groups": 8,
                "tokens": 4000 + 10 * step,
                "reward_mean": step / steps,
                "staleness_mean": 0.5 + (step % 3) / 3,
                "staleness_max": step % 3,
                "behaviour_weight_mean": 0.99,
                "clip_fraction": 0.01 * (step % 5),
                "loss": 0.1,
                "step_seconds": 1.5,
                "length_bias_ks": 0.3 / step,
                "episode_tokens_generated": 20.0 + step % 4,
                "episode_tokens_trained": 18.0 + step % 3,
                "episode_seconds_generated": 3.0,
                "episode_seconds_trained": 2.5,
                **TimeSplit(2.0, _split(TRAINER_PHASES, wait=0.3, forward_backward=0.6)).fields(),
            }
            if step == 7:
                del line["staleness_mean"], line["clip_fraction"]  # older trainers lacked them
            w.write(line)
            if step % 10 == 0:
                w.write({"step": step, "wall_seconds": 2.0 * step + 1, "eval_accuracy": step / 40})
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 31, "rew')  # the trainer was killed mid-write
    with JsonlWriter(run_dir / ROLLOUT_LOG) as w:
        for i in range(12):
            split = TimeSplit(10.0, _split(ROLLOUT_PHASES, decode=0.5, hold=0.1 * (i % 3)))
            w.write(
                WorkerRecord(f"w{i % 2}", 10.0 * (i // 2 + 1), i, 50, 2, **split.fields()).to_json()
            )


def _split(phases: tuple[str, ...], **shares: float) -> dict[str, float]:
    return {p: 0.0 for p in phases} | shares | {"other": 1.0 - sum(shares.values())}


def test_plot_writes_valid_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path)
    assert main(tmp_path, None) == 0
    names = ["reward", "staleness", "length_bias", "correction", "throughput", "time"]
    files = [tmp_path / "plots" / f"{name}.png" for name in names]
    printed = capsys.readouterr().out.split()
    assert printed == [str(f) for f in files]
    for f in files:
        width, height = png_size(f)
        assert width > 300 and height > 300
        assert f.stat().st_size > 10_000  # curves, axes and labels, not a blank canvas
    reward_w, _ = png_size(files[0])
    assert reward_w > png_size(files[1])[0]  # two panels side by side: vs step and vs time


def test_plot_skips_figures_without_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with JsonlWriter(tmp_path / "metrics.jsonl") as w:
        w.write({"step": 1, "wall_seconds": 1.0, "reward_mean": 0.1})
        w.write({"step": 2, "wall_seconds": 2.0, "reward_mean": 0.3})
    out = tmp_path / "elsewhere"
    assert main(tmp_path, out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["reward.png"]
    assert "skipped staleness.png: no data" in capsys.readouterr().out


def test_plot_without_a_log_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(tmp_path / "no-such-run", None) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(tmp_path, None) == 2
    assert not (tmp_path / "plots").exists()
