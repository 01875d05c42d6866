"""Shared fixtures: a real redis-server per test that needs one, started and stopped here."""

from __future__ import annotations

import functools
import secrets
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import redis

from asyncrl.launch.redis_server import RedisServer

from role_procs import REPO, Launched, RoleConfig, Run, launch_all, write_role_config

if TYPE_CHECKING:
    from weights_harness import Harness


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with the most `slow` tests first: under the README's `-n 2 --dist loadfile` each
    worker takes whole modules in this order, and a long one taken last would leave the other
    worker idle while it runs alone."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(data_dir=tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server for all tests of a module, for runs and trainers that they share."""
    with RedisServer(data_dir=tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server that requires `.password`, random per test so a grep finds only leaks."""
    password = "pw-" + secrets.token_hex(12)
    with RedisServer(data_dir=tmp_path / "password-redis", password=password) as server:
        yield server


@pytest.fixture
def role_config(tmp_path: Path, redis_server: RedisServer, random_model: Path) -> RoleConfig:
    """Writes the config of role processes on this test's Redis and the random tiny model
    (`role_procs.write_role_config`)."""
    return functools.partial(write_role_config, tmp_path, redis_server.url, random_model)


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server.url) as client:
        yield client


@pytest.fixture
def user_code(tmp_path: Path) -> Path:
    """A folder for the test's plugin code, outside the checkout: what loads from it cannot come
    from the repo."""
    user = tmp_path / "user_code"
    user.mkdir()
    assert not str(user.resolve()).startswith(str(REPO))
    return user


def _launcher(url: str, model: Path, run_dir: Callable[[str], Path]) -> Launched:
    def launch(run_id: str, *overrides: str, mode: str = "async") -> Run:
        run = launch_all(run_dir(run_id), url, model, run_id, *overrides, mode=mode)
        assert run.rc == 0, run.output[-5000:]
        return run

    return launch


@pytest.fixture(scope="module")
def launched(
    module_redis: RedisServer, warm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Launched:
    """Runs `asyncrl launch --role all` (`role_procs.launch_all`) on the module's Redis and the
    warmed model, in a fresh folder named after the run id, and checks that it exited 0."""
    return _launcher(
        module_redis.url, warm_model, lambda run_id: tmp_path_factory.mktemp(run_id) / "run"
    )


@pytest.fixture
def launched_here(redis_server: RedisServer, warm_model: Path, tmp_path: Path) -> Launched:
    """`launched` on the test's own Redis, in `tmp_path / "run"`."""
    return _launcher(redis_server.url, warm_model, lambda _: tmp_path / "run")


@pytest.fixture(scope="session")
def warm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The warmed quickstart model (`build_tiny_model`), built once per test session (~35 s)."""
    from asyncrl.tiny_model import build_tiny_model

    out = tmp_path_factory.mktemp("warm") / "tiny-add2"
    build_tiny_model(out)
    return out


@pytest.fixture(scope="session")
def random_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny model with the quickstart tokenizer (seed 0), made once per session."""
    from asyncrl.tiny_model import save_random_tiny_model

    return save_random_tiny_model(tmp_path_factory.mktemp("random") / "tiny", seed=0)


@pytest.fixture(scope="session")
def random_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained tiny Qwen3-MoE (2 layers, 8 experts, top-2) with the quickstart tokenizer."""
    from asyncrl.tiny_model import save_random_tiny_model

    return save_random_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-moe", seed=0, moe=True)


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny model whose tokenizer spells lower-case text and has a chat template."""
    from transformers import AutoTokenizer

    from asyncrl.tiny_model import save_random_tiny_model

    chars = " abcdefghijklmnopqrstuvwxyz:.,?!\n0123456789+="
    out = save_random_tiny_model(tmp_path_factory.mktemp("chat") / "tiny", seed=0, chars=chars)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def served(random_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`asyncrl serve` on the random tiny model, one per test module (tests change its weights)."""
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncrl", "serve", "--model", str(random_model), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # printed once the socket is bound
        assert "listening on" in line, f"serve did not start: {line!r}"
        yield line.rsplit(" ", 1)[-1].strip()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@pytest.fixture
def harness(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> Iterator[Harness]:
    """A weight publisher here and subscriber processes (`weights_harness`)."""
    from weights_harness import Harness  # torch: only for the tests that use it

    h = Harness(redis_server, redis_client, tmp_path)
    try:
        yield h
    finally:
        h.close()
