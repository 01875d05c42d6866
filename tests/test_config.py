"""Config: every shipped YAML parses; bad input gives one clear line naming the key, exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.cli import main
from asyncrl.config import ConfigError, load_config
from asyncrl.engines.config import TorchEngineConfig

from role_procs import asyncrl

ROOT = Path(__file__).resolve().parents[1]


def _shipped_run_configs() -> list[Path]:
    return sorted([*(ROOT / "configs").glob("*.yaml"), *(ROOT / "examples").rglob("*.yaml")])


@pytest.mark.parametrize("path", _shipped_run_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_parses(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Examples name their plugins' directories relative to the repo root, where they are run.
    monkeypatch.chdir(ROOT)
    cfg = load_config(path)
    assert cfg.run.id


def test_every_yaml_under_deploy_parses() -> None:
    """Deploy files are YAML too; the run configs they embed are checked in test_deploy."""
    for path in sorted((ROOT / "deploy").rglob("*.y*ml")) if (ROOT / "deploy").exists() else []:
        docs = list(yaml.safe_load_all(path.read_text()))
        assert docs, path


def test_overrides_are_typed_and_nested() -> None:
    cfg = load_config(None, ["trainer.max_steps=7", "algo.max_staleness=0", "run.id=exp1"])
    assert cfg.trainer.max_steps == 7
    assert cfg.algo.max_staleness == 0
    assert cfg.run.path == Path("runs/exp1")


@pytest.mark.parametrize(
    ("overrides", "key", "hint"),
    [
        (["algo.weight_cap=0"], "algo.weight_cap", "≥ 1"),
        (["algo.weight_cap=0.5"], "algo.weight_cap", "≥ 1"),
        (["algo.mask_low=1.5", "algo.mask_high=3"], "algo.mask_low", "[0, 1]"),
        (["algo.kl_coef=0.1", "algo.kl_in=reward"], "algo.kl_in", "not implemented"),
        (["algo.max_staleness=-1"], "algo.max_staleness", "greater than or equal to 0"),
        (["algo.loss=reinforce"], "algo.loss", "'ppo' or 'gspo'"),
        (["trainer.lr=abc"], "trainer.lr", "number"),
        (["trainer.bogus=1"], "trainer.bogus", "allowed keys"),
        (["weights.type=carrier-pigeon"], "weights.type", "'broadcast', 'store', 'sglang'"),
        (["task.type=chess"], "task", "arithmetic"),
        (["rollout.sampling.temperature=0"], "rollout.sampling.temperature", "> 0"),
        (["algo.loss=gspo"], "algo.aggregation", "seq-mean-token-mean"),
        (["redis.url=http://x"], "redis.url", "redis://"),
        (["nokey"], "nokey", "key=value"),
        (["trainer.ranks=0"], "trainer.ranks", "greater than or equal to 1"),
        (["trainer.ranks=3"], "trainer.ranks=3", "multiple"),
    ],
)
def test_bad_config_names_the_key(overrides: list[str], key: str, hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert key in message
    assert hint in message
    assert "\n" not in message


def test_bad_yaml_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_cli_config_error_is_one_line_exit_2(tmp_path: Path) -> None:
    proc = launch_cli("--role", "trainer", "algo.max_staleness=-3")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "algo.max_staleness" in lines[0]
    assert "Traceback" not in proc.stderr


def launch_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return asyncrl("launch", *args, timeout=timeout)


def assert_config_error(proc: subprocess.CompletedProcess[str], key: str) -> None:
    """Exit 2 with one line on stderr that names `key`, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("asyncrl: config error: ") and key in lines[0], lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "key"),
    [
        # Each passed validation before and failed only once a role ran with it.
        ("trainer.lr=.inf", "trainer.lr"),  # NaN weights reached the workers
        ("algo.eps=.nan", "algo.eps"),  # no bound of its own to refuse NaN
        ("trainer.lr=1e39", "trainer.lr"),  # torch: "value cannot be converted to type float"
        ("trainer.betas=[2,3]", "trainer.betas"),  # AdamW refused them after the model loaded
        ("queue.claim_idle_s=.inf", "queue.claim_idle_s"),  # OverflowError
        ("rollout.heartbeat_ttl_s=.inf", "rollout.heartbeat_ttl_s"),  # no heartbeat at all
        ("redis.block_ms=-5", "redis.block_ms"),
        ("redis.connect_timeout_s=0", "redis.connect_timeout_s"),
    ],
)
def test_values_that_would_fail_later_are_config_errors(override: str, key: str) -> None:
    assert_config_error(launch_cli("--role", "trainer", "redis.url=redis://x:1/0", override), key)


@pytest.mark.parametrize("config", ["configs/quickstart.yaml", "configs/agentic.yaml"])
def test_a_held_out_split_larger_than_the_pair_space_is_a_config_error(config: str) -> None:
    # 1-digit operands make 100 pairs: the default 500 held out crashed both roles at start.
    proc = launch_cli("--role", "trainer", "--config", config, "task.digits=1")
    assert_config_error(proc, "task.eval_size")


def test_trainer_ranks_flag() -> None:
    """`--trainer-ranks N` is `trainer.ranks=N`, checked before anything starts."""
    proc = launch_cli("--role", "all", "--trainer-ranks", "2", "--print-config")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["trainer"]["ranks"] == 2
    assert_config_error(
        launch_cli("--role", "all", "--launcher", "ray", "--trainer-ranks", "5"), "trainer.ranks"
    )


@pytest.mark.parametrize("role", ["trainer", "rollout", "all"])
def test_a_missing_model_is_a_config_error_before_redis(role: str, tmp_path: Path) -> None:
    """The role exits 2 naming model.path without a single connection to its Redis (a bare
    listener that would take one), and `--role all` starts no embedded Redis."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        url = [] if role == "all" else [f"redis.url=redis://127.0.0.1:{port}/0"]
        proc = launch_cli(
            "--role",
            role,
            f"run.dir={tmp_path / 'run'}",
            f"model.path={tmp_path / 'absent'}",
            "model.build_tiny=false",
            *url,
        )
        assert_config_error(proc, "model.path")
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    assert not (tmp_path / "run" / "redis").exists()


def test_print_config_redacts_password(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["launch", "--role", "trainer", "--print-config", "redis.url=redis://:s3cret@host:6379/0"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "s3cret" not in out
    printed = yaml.safe_load(out)
    assert printed["redis"]["url"] == "redis://:***@host:6379/0"


def test_help_is_fast_and_imports_nothing_heavy() -> None:
    code = (
        "import sys; from asyncrl.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'redis', 'numpy') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_config_import_pulls_no_torch() -> None:
    code = "import sys, asyncrl.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_lr_schedules_hand_worked() -> None:
    cfg = load_config(None, ["trainer.lr=1.0", "trainer.max_steps=10", "trainer.lr_min_ratio=0.1"])
    assert cfg.trainer.lr_at(0) == 1.0
    assert cfg.trainer.lr_at(10) == 1.0
    linear = load_config(
        None, ["trainer.lr=1.0", "trainer.max_steps=10", "trainer.lr_decay=linear"]
    )
    assert linear.trainer.lr_at(5) == pytest.approx(0.55)
    assert linear.trainer.lr_at(10) == pytest.approx(0.1)
    cosine = load_config(
        None, ["trainer.lr=1.0", "trainer.max_steps=10", "trainer.lr_decay=cosine"]
    )
    assert cosine.trainer.lr_at(0) == pytest.approx(1.0)
    assert cosine.trainer.lr_at(5) == pytest.approx(0.55)
    assert cosine.trainer.lr_at(10) == pytest.approx(0.1)
    assert cosine.trainer.lr_at(2) > linear.trainer.lr_at(2)


def test_weights_member_follows_the_engine() -> None:
    sglang = ["rollout.engine.type=sglang", 'rollout.engine.urls=["http://127.0.0.1:1"]']
    for overrides in (sglang, ["weights.type=sglang"]):
        with pytest.raises(ConfigError, match=r"weights\.type must be sglang"):
            load_config(None, overrides)
    cfg = load_config(None, [*sglang, "weights.type=sglang", "weights.transport=store"])
    assert cfg.weights.type == "sglang" and cfg.weights.store_dir == cfg.run.path / "weights"


def test_engine_owns_its_device() -> None:
    cfg = load_config(None, ["trainer.device=cpu", "rollout.engine.device=npu"])
    assert cfg.rollout.engine.type == "torch" and cfg.rollout.engine.device == "npu"
    assert load_config(None, []).rollout.engine == TorchEngineConfig(device="auto")


def test_the_mismatch_audit_needs_the_builtin_engine() -> None:
    sglang = ["rollout.engine.type=sglang", 'rollout.engine.urls=["http://127.0.0.1:1"]']
    with pytest.raises(ConfigError, match=r"rollout\.audit_fraction needs rollout\.engine\.type"):
        load_config(None, [*sglang, "weights.type=sglang", "rollout.audit_fraction=0.1"])
    with pytest.raises(ConfigError, match=r"rollout\.audit_fraction"):
        load_config(None, ["rollout.audit_fraction=1.5"])
    assert load_config(None, []).rollout.audit_fraction == 0.0


def test_routing_replay_needs_the_routing_and_no_prefix_cache() -> None:
    with pytest.raises(ConfigError, match=r"algo\.routing_replay needs rollout\.capture_routing"):
        load_config(None, ["algo.routing_replay=true"])
    with pytest.raises(
        ConfigError, match=r"rollout\.capture_routing needs .*prefix_cache_tokens=0"
    ):
        load_config(None, ["rollout.capture_routing=true", "rollout.engine.prefix_cache_tokens=64"])
    cfg = load_config(ROOT / "configs" / "quickstart_moe.yaml")
    assert cfg.rollout.capture_routing and cfg.algo.routing_replay and cfg.model.tiny_moe
