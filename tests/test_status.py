import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from asyncrl.cli import main as cli_main
from asyncrl.launch.progress import Mode, Progress
from asyncrl.launch.redis_server import RedisServer, free_port
from asyncrl.launch.status import collect_status
from asyncrl.metrics.jsonl import JsonlWriter
from asyncrl.runstate import PROMPTS_GROUP, TRAJECTORIES_GROUP, Counter, Keys

STATUS_KEYS = {
    "doctor",
    "run_id",
    "version",
    "streams",
    "counters",
    "in_flight",
    "balanced",
    "workers",
    "last_step",
}


def populate(client: redis.Redis, keys: Keys) -> None:
    """A run caught mid-flight: prompts 6 (2 acked, 2 pending, 2 lag), trajectories 3 (1 pending,
    2 lag), 1 dead letter; 12 released = 3 trained + 1 dropped + 1 dead-lettered + 7 in flight
    (the 4 prompts and 3 trajectories still queued); 2 junk entries rejected."""
    client.xgroup_create(keys.prompts, PROMPTS_GROUP, id="0", mkstream=True)
    ids = [client.xadd(keys.prompts, {"data": f"p{i}"}) for i in range(6)]
    client.xreadgroup(PROMPTS_GROUP, "w1", {keys.prompts: ">"}, count=4)
    client.xack(keys.prompts, PROMPTS_GROUP, *ids[:2])

    client.xgroup_create(keys.trajectories, TRAJECTORIES_GROUP, id="0", mkstream=True)
    for i in range(3):
        client.xadd(keys.trajectories, {"data": f"t{i}"})
    client.xreadgroup(TRAJECTORIES_GROUP, "trainer-0", {keys.trajectories: ">"}, count=1)
    client.xadd(keys.dlq, {"reason": "schema"})
    client.hset(keys.released, mapping={f"{i}-0": "" for i in range(7)})

    client.hset(
        keys.counters,
        mapping={
            Counter.PROMPTS_RELEASED: 12,
            Counter.GROUPS_PUBLISHED: 6,
            Counter.GROUPS_TRAINED: 3,
            Counter.GROUPS_DROPPED_STALE: 1,
            Counter.GROUPS_DEAD_LETTERED: 1,
            Counter.ENTRIES_REJECTED: 2,
        },
    )
    client.set(keys.version, 4)
    now = time.time()
    for role, wid, age, version in [
        ("rollout", "w2", 1.0, 3),
        ("rollout", "w1", 2.0, 4),
        ("trainer", "trainer-0", 0.5, 4),
    ]:
        beat = msgpack.packb({"ts": now - age, "version": version, "state": "generating"})
        client.set(keys.worker(role, wid), beat, ex=30)


def test_collect_status_reads_every_field(redis_client: redis.Redis, tmp_path: Path) -> None:
    keys = Keys("st1")
    populate(redis_client, keys)
    redis_client.set(keys.last_step, json.dumps({"step": 9, "version": 4, "reward_mean": 0.5}))

    status = collect_status(redis_client, keys, tmp_path)

    assert set(status) == STATUS_KEYS
    assert status["run_id"] == "st1"
    assert status["version"] == 4
    assert status["streams"] == {
        "prompts": {"length": 6, "lag": 2, "pending": 2},
        "trajectories": {"length": 3, "lag": 2, "pending": 1},
        "dlq": {"length": 1},
    }
    assert status["counters"] == {
        Counter.PROMPTS_RELEASED: 12,
        Counter.GROUPS_PUBLISHED: 6,
        Counter.GROUPS_TRAINED: 3,
        Counter.GROUPS_DROPPED_STALE: 1,
        Counter.GROUPS_DEAD_LETTERED: 1,
        Counter.GROUPS_LOST: 0,
        Counter.ENTRIES_REJECTED: 2,
    }
    assert status["in_flight"] == 7
    assert status["balanced"] is True
    rollout = status["workers"]["rollout"]
    assert [(w["id"], w["version"]) for w in rollout] == [("w1", 4), ("w2", 3)]
    assert set(rollout[0]) == {"id", "age_s", "version"}
    assert 1.5 <= rollout[0]["age_s"] < 10
    assert [w["id"] for w in status["workers"]["trainer"]] == ["trainer-0"]
    assert status["last_step"] == {"step": 9, "version": 4, "reward_mean": 0.5}
    json.dumps(status)  # plain data only

    redis_client.hincrby(keys.counters, Counter.PROMPTS_RELEASED, 1)  # a prompt nobody accounts for
    assert collect_status(redis_client, keys, tmp_path)["balanced"] is False


def test_a_fresh_run_reads_as_zeros(redis_client: redis.Redis, tmp_path: Path) -> None:
    status = collect_status(redis_client, Keys("nothing-yet"), tmp_path)
    zeros = {"length": 0, "lag": 0, "pending": 0}
    assert status["version"] is None
    assert status["streams"] == {"prompts": zeros, "trajectories": zeros, "dlq": {"length": 0}}
    assert status["counters"] == dict.fromkeys(Counter, 0)
    assert status["balanced"] is True
    assert status["workers"] == {"rollout": [], "trainer": []}
    assert status["last_step"] is None


def test_last_step_falls_back_to_the_log(redis_client: redis.Redis, tmp_path: Path) -> None:
    with JsonlWriter(tmp_path / "metrics.jsonl") as w:
        w.write({"step": 1, "version": 1, "wall_seconds": 1.0, "reward_mean": 0.1})
        w.write({"step": 2, "version": 2, "wall_seconds": 2.0, "reward_mean": 0.2})
        w.write({"step": 2, "wall_seconds": 2.5, "eval_accuracy": 0.7})
    status = collect_status(redis_client, Keys("log-only"), tmp_path)
    assert status["last_step"] == {"step": 2, "version": 2, "wall_seconds": 2.0, "reward_mean": 0.2}


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(data_dir=tmp_path / "pw-redis", password="pa55-S3cret").start()
    try:
        yield server
    finally:
        server.stop()


def test_cli_status_json_hides_the_password(
    password_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"redis://:pa55-S3cret@127.0.0.1:{password_server.port}/0"
    client = redis.Redis.from_url(url)
    populate(client, Keys("cli1"))
    client.close()
    args = [f"redis.url={url}", "run.id=cli1", f"run.dir={tmp_path / 'run'}"]

    assert cli_main(["status", "--json", *args]) == 0
    out, err = capsys.readouterr()
    status = json.loads(out)
    assert set(status) == STATUS_KEYS
    assert status["streams"]["prompts"] == {"length": 6, "lag": 2, "pending": 2}
    assert status["balanced"] is True
    assert "pa55-S3cret" not in out + err

    assert cli_main(["status", *args]) == 0
    out, err = capsys.readouterr()
    assert "pa55-S3cret" not in out + err
    assert ":***@127.0.0.1" in out
    assert "balanced" in out and "w1" in out


def test_cli_status_finds_the_local_redis(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "redis").mkdir(parents=True)
    (run_dir / "redis" / "url").write_text(redis_server.url + "\n")
    client = redis.Redis.from_url(redis_server.url)
    client.set(Keys("local1").version, 3)
    client.close()

    assert cli_main(["status", "--json", "run.id=local1", f"run.dir={run_dir}"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 3


def test_cli_status_without_redis_shows_the_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with JsonlWriter(run_dir / "metrics.jsonl") as w:
        w.write({"step": 5, "version": 5, "reward_mean": 0.3})
    url = f"redis://:pa55-S3cret@127.0.0.1:{free_port()}/0"  # nothing listens there

    code = cli_main(["status", "--json", f"redis.url={url}", "run.id=gone", f"run.dir={run_dir}"])
    out, err = capsys.readouterr()
    assert code == 1
    status = json.loads(out)
    assert set(status) == STATUS_KEYS
    assert status["streams"] is None and status["version"] is None
    assert status["last_step"] == {"step": 5, "version": 5, "reward_mean": 0.3}
    assert "not reachable" in err
    assert "pa55-S3cret" not in out + err


def test_cli_status_shows_the_length_bias(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    step = {"step": 5, "length_bias_ks": 0.25, "episode_tokens_generated": 30.0}
    with JsonlWriter(run_dir / "metrics.jsonl") as w:
        w.write(step | {"episode_tokens_trained": 21.5})
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there: the run dir's line

    cli_main(["status", f"redis.url={url}", "run.id=gone", f"run.dir={run_dir}"])
    row = next(line for line in capsys.readouterr().out.splitlines() if "length bias" in line)
    assert "KS 0.25" in row and "tokens 30 → 21.5" in row and "turns - → -" in row


@pytest.mark.parametrize("as_json", [True, False])
def test_cli_status_of_a_run_not_in_redis_says_there_is_none(
    redis_server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    """A run id Redis holds nothing of (mistyped, or never started) is no healthy empty run: one
    line says there is no such run, and the exit status is not 0 — with --json too."""
    client = redis.Redis.from_url(redis_server.url)
    populate(client, Keys("real"))  # another run lives in the same Redis
    client.close()
    args = [f"redis.url={redis_server.url}", "run.id=typo", f"run.dir={tmp_path / 'run'}"]

    code = cli_main(["status", *(["--json"] if as_json else []), *args])
    out, err = capsys.readouterr()
    assert code == 1
    assert err.count("\n") == 1 and "no run 'typo' in Redis" in err, err
    if as_json:
        status = json.loads(out)
        assert set(status) == STATUS_KEYS
        assert status["streams"] is None and status["counters"] is None
        assert status["balanced"] is None
    else:
        assert "no such run" in out and "balanced" not in out


def test_progress_json_copies_whole_new_lines(tmp_path: Path) -> None:
    out = io.StringIO()
    progress = Progress("json", tmp_path, None, Keys("p1"), max_steps=10, out=out)
    progress.update()  # no metrics.jsonl yet
    log = tmp_path / "metrics.jsonl"
    with JsonlWriter(log) as w:
        w.write({"step": 1, "reward_mean": 0.1})
        w.write({"step": 1, "eval_accuracy": 0.4})
    with log.open("a") as f:
        f.write('{"step": 2, "rew')  # the trainer is mid-write
    progress.update()
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [
        {"step": 1, "reward_mean": 0.1},
        {"step": 1, "eval_accuracy": 0.4},
    ]
    with log.open("a") as f:
        f.write('ard_mean": 0.2}\n')
    progress.close()
    assert json.loads(out.getvalue().splitlines()[-1]) == {"step": 2, "reward_mean": 0.2}


def test_progress_quiet_shows_redis_figures(redis_client: redis.Redis, tmp_path: Path) -> None:
    keys = Keys("p2")
    populate(redis_client, keys)
    with JsonlWriter(tmp_path / "metrics.jsonl") as w:
        w.write({"step": 3, "version": 3, "reward_mean": 0.25, "tokens": 600, "step_seconds": 2.0})
    out = io.StringIO()
    progress = Progress("quiet", tmp_path, redis_client, keys, max_steps=50, out=out)
    progress.update()
    progress.update()  # within the quiet interval: no second line
    line = out.getvalue()
    assert line.count("\n") == 1
    assert line.startswith("step 3/50 · v3 · reward 0.25 · ")
    assert "lag 2+2 pending 2+1 · 300 tok/s · workers 2r+1t" in line


def test_progress_survives_a_dead_redis(tmp_path: Path) -> None:
    # No retries: redis-py's default backoff would only make the test slow.
    dead = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    out = io.StringIO()
    modes: tuple[Mode, ...] = ("live", "quiet")
    for mode in modes:
        progress = Progress(mode, tmp_path, dead, Keys("p3"), max_steps=None, out=out)
        progress.update()
        progress.close()
    assert "unreachable" in out.getvalue()
