"""The environment seam: the env-server's HTTP/JSON protocol and its client (placement,
pinning, retry before the first step only, bounded concurrency, every failure as a reason), and
the scheduler driving a user environment (observations as text and chat, rewards given or left
to the task, timeouts, malformed replies)."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncrl.environments.base import EnvironmentFailure, StepResult
from asyncrl.environments.client import RemotePool
from asyncrl.environments.config import RemoteEnvironmentConfig
from asyncrl.environments.server import make_server
from asyncrl.items import PromptItem

from role_procs import CHILD_ENV, wait_until

ITEM = PromptItem("12+34", "12+34=", [1, 4, 5, 13, 6, 7, 14], "46")

ENVS = """
import asyncio, time
from asyncrl.environments import StepResult

class Echo:
    live = 0
    most = 0
    closed = 0

    def __init__(self, turns=2, sleep_s=0.0, close_log=None, silent=False):
        self.turns, self.sleep_s, self.seen = turns, sleep_s, []
        self.close_log, self.silent = close_log, silent

    async def reset(self, item):
        return None if self.silent else f"first {item.prompt_id} {item.answer}"

    async def step(self, response):
        Echo.live += 1
        Echo.most = max(Echo.most, Echo.live)
        try:
            await asyncio.sleep(self.sleep_s)
        finally:
            Echo.live -= 1
        self.seen.append(response)
        if response == "raise":
            raise RuntimeError("the tool broke")
        if response == "hang":
            await asyncio.sleep(3600)
        if response == "bad":
            return StepResult(None, done=True, reward=float("nan"))
        if len(self.seen) == self.turns:
            return StepResult(None, done=True, reward=len(self.seen), info={"seen": self.seen})
        return StepResult([{"role": "user", "content": response}], done=False)

    async def close(self):
        Echo.closed += 1
        if self.close_log:  # how a test counts, from outside, the sessions a server closed
            with open(self.close_log, "a") as f:
                f.write("closed\\n")
"""


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("envs")
    (d / "user_envs.py").write_text(textwrap.dedent(ENVS))
    return d


class Served:
    def __init__(self, env_dir: Path, **kw: Any) -> None:
        self.httpd = make_server(
            "user_envs:Echo", kw.pop("kwargs", {}), python_path=[str(env_dir)], **kw
        )
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health").json()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def served(env_dir: Path) -> Iterator[Served]:
    s = Served(env_dir)
    yield s
    s.stop()


def _pool(*urls: str, **kw: Any) -> RemotePool:
    return RemotePool(RemoteEnvironmentConfig(urls=list(urls), **kw))


def _dead_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_session_round_trip_over_http(served: Served) -> None:
    version = httpx.get(f"{served.url}/version").json()
    assert version["protocol"] == 1 and version["env"] == "user_envs:Echo"

    import user_envs  # the module the in-process server imported

    closed = user_envs.Echo.closed

    async def episode() -> list[Any]:
        env = _pool(served.url).environment()
        first = await env.reset(ITEM)
        mid = await env.step("46")
        assert served.health()["sessions"] == 1
        last = await env.step("47")
        # The step that ends the episode ends its session: the environment is closed without
        # a DELETE, which would find no session now.
        assert served.health()["sessions"] == 0
        wait_until(lambda: user_envs.Echo.closed == closed + 1, 10, "the session closed")
        session = env._session  # a later DELETE of it, as any client may send
        assert httpx.delete(f"{served.url}/v1/sessions/{session}").status_code == 404
        await env.close()
        return [first, mid, last]

    first, mid, last = asyncio.run(episode())
    assert user_envs.Echo.closed == closed + 1
    assert first == "first 12+34 46"
    assert mid == StepResult([{"role": "user", "content": "46"}], done=False, reward=None)
    assert last == StepResult(None, done=True, reward=2.0, info={"seen": ["46", "47"]})
    assert served.health()["sessions"] == 0


@pytest.mark.parametrize(
    ("response", "reason", "detail"),
    [("raise", "error", "RuntimeError: the tool broke"), ("bad", "malformed", "reward=nan")],
)
def test_an_environment_that_raises_or_answers_badly_fails_with_its_reason(
    served: Served, response: str, reason: str, detail: str
) -> None:
    async def episode() -> None:
        env = _pool(served.url).environment()
        await env.reset(ITEM)
        await env.step(response)

    with pytest.raises(EnvironmentFailure) as failed:
        asyncio.run(episode())
    assert failed.value.reason == reason and detail in failed.value.detail


def test_a_step_past_its_timeout_fails_and_close_ends_the_session(served: Served) -> None:
    async def episode() -> None:
        env = _pool(served.url, timeout_s=0.5).environment()
        await env.reset(ITEM)
        try:
            await env.step("hang")
        finally:
            await env.close()

    t0 = time.monotonic()
    with pytest.raises(EnvironmentFailure) as failed:
        asyncio.run(episode())
    assert failed.value.reason == "timeout" and time.monotonic() - t0 < 30  # not hung
    assert served.health()["sessions"] == 0  # the hung call was cancelled with its session


def test_a_session_no_call_used_for_the_idle_timeout_is_closed(env_dir: Path) -> None:
    """A worker SIGKILLed mid-episode leaves its sessions open: the server closes each after
    `idle_timeout_s` without a call starting or ending — one whose call has run that long too
    (hung, its worker gone), the call cancelled."""
    s = Served(env_dir, idle_timeout_s=1.0)
    import user_envs  # importable once the server loaded it

    closed = user_envs.Echo.closed
    try:

        async def episodes() -> None:
            pool = _pool(s.url, timeout_s=60)
            idle, hung = pool.environment(), pool.environment()
            await idle.reset(ITEM)
            await hung.reset(ITEM)
            with pytest.raises(EnvironmentFailure) as cancelled:
                await hung.step("hang")  # in flight past the idle timeout
            assert "cancelled: the session was closed" in cancelled.value.detail
            assert s.health()["sessions"] == 0
            with pytest.raises(EnvironmentFailure) as gone:
                await idle.step("46")
            assert gone.value.reason == "unavailable"  # 404: no such session any more

        asyncio.run(episodes())
        assert user_envs.Echo.closed == closed + 2
    finally:
        s.stop()


def test_an_env_server_exports_its_metrics_to_a_prometheus_scrape(env_dir: Path) -> None:
    """`GET /metrics` of a real `asyncrl env-server` process, parsed by prometheus_client: the
    requests of one episode and a refused step by outcome, its calls timed, no session left."""
    from prometheus_client.parser import text_string_to_metric_families

    from asyncrl.environments.server import spawn

    environ = {**os.environ, **CHILD_ENV}
    proc, url = spawn("user_envs:Echo", "--python-path", str(env_dir), environ=environ, quiet=True)
    try:

        async def episode() -> None:
            env = _pool(url).environment()
            await env.reset(ITEM)
            await env.step("46")
            await env.step("47")  # done: the session ends with it
            with pytest.raises(EnvironmentFailure):
                await env._pool.call(url, "POST", "/v1/sessions/nope/step", {"response": "x"})

        asyncio.run(episode())
        scrape = httpx.get(f"{url}/metrics")
    finally:
        proc.terminate()
        proc.wait()
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, s.labels.get("outcome")): s.value
        for family in text_string_to_metric_families(scrape.text)
        for s in family.samples
    }
    assert samples["asyncrl_env_server_requests_total", "ok"] == 3
    assert samples["asyncrl_env_server_requests_total", "refused"] == 1
    assert samples["asyncrl_env_server_requests_total", "error"] == 0
    assert samples["asyncrl_env_server_call_seconds_count", None] == 3  # reset and two steps
    assert samples["asyncrl_env_server_sessions", None] == 0
    assert samples["asyncrl_env_server_sessions_closed_idle_total", None] == 0


class _Garbage(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = (
            b"<html>proxy error"
            if self.path.endswith("/step")
            else json.dumps({"protocol": 1, "session": "s", "observation": None}).encode()
        )
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_reply_that_is_not_json_is_malformed() -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    async def episode() -> None:
        env = _pool(f"http://127.0.0.1:{httpd.server_port}").environment()
        await env.reset(ITEM)
        await env.step("46")

    try:
        with pytest.raises(EnvironmentFailure) as failed:
            asyncio.run(episode())
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert failed.value.reason == "malformed" and "not JSON" in failed.value.detail


class Process:
    """`asyncrl env-server` of `user_envs:Echo` in a process of its own, to be killed."""

    def __init__(self, env_dir: Path, kwargs: dict[str, Any] | None = None) -> None:
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "asyncrl", "env-server", "--env", "user_envs:Echo"),
                *("--python-path", str(env_dir), "--port", "0"),
                *("--kwargs", json.dumps(kwargs or {})),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **CHILD_ENV},
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "listening on" in line, line
        self.url = line.split()[-1]

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health").json()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_create_retries_on_the_next_server_and_sessions_stay_where_made(env_dir: Path) -> None:
    a, b = Process(env_dir), Served(env_dir, max_sessions=1)
    dead = _dead_url()
    try:

        async def episodes() -> None:
            pool = _pool(a.url, b.url, dead, retries=2)
            envs = [pool.environment() for _ in range(3)]
            # Round the servers: a, b, dead → retried on a.
            for env in envs:
                await env.reset(ITEM)
            assert (a.health()["sessions"], b.health()["sessions"]) == (2, 1)
            extras = [pool.environment() for _ in range(2)]
            for env in extras:  # a; then b, full (max_sessions=1) → dead → a
                await env.reset(ITEM)
            assert (a.health()["sessions"], b.health()["sessions"]) == (4, 1)
            extra = extras[1]
            for env in [*envs, extra]:
                assert (await env.step("x")).done is False  # on the server that made it
            # After its first step an episode is not restarted elsewhere: its server going
            # away fails it.
            a.stop()
            with pytest.raises(EnvironmentFailure) as failed:
                await envs[0].step("y")
            assert failed.value.reason == "unavailable"

        asyncio.run(episodes())
    finally:
        a.stop()
        b.stop()


def test_no_server_to_take_an_episode_is_unavailable() -> None:
    async def episode() -> None:
        await _pool(_dead_url(), _dead_url(), retries=5).environment().reset(ITEM)

    with pytest.raises(EnvironmentFailure) as failed:
        asyncio.run(episode())
    assert failed.value.reason == "unavailable"


def test_calls_in_flight_per_server_are_bounded(env_dir: Path) -> None:
    s = Served(env_dir, kwargs={"turns": 5, "sleep_s": 0.2})
    import user_envs  # the same module object the server imported

    user_envs.Echo.most = 0
    try:

        async def episodes() -> None:
            pool = _pool(s.url, max_sessions_per_server=2)
            envs = [pool.environment() for _ in range(6)]
            for env in envs:
                await env.reset(ITEM)
            await asyncio.gather(*(env.step("x") for env in envs))

        asyncio.run(episodes())
    finally:
        s.stop()
    assert user_envs.Echo.most == 2


def test_env_server_option_errors_are_one_line_exit_2(env_dir: Path) -> None:
    from role_procs import asyncrl

    bad = asyncrl("env-server", "--env", "user_envs:Nope", "--python-path", str(env_dir))
    assert bad.returncode == 2 and "has no attribute 'Nope'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    bad = asyncrl("env-server", "--env", "user_envs:Echo", "--kwargs", "[1]")
    assert bad.returncode == 2 and "not a JSON object" in bad.stderr
    bad = asyncrl("env-server", "--env", "user_envs:Echo", "--idle-timeout-s", "nan")
    assert bad.returncode == 2 and "--idle-timeout-s" in bad.stderr


def test_config_errors_name_the_key(env_dir: Path) -> None:
    from asyncrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"task\.environment\.path.*Nope"):
        load_config(
            None,
            [
                "task.type=arithmetic",
                'task.environment={type: python, path: "user_envs:Nope", python_path: ['
                + json.dumps(str(env_dir))
                + "]}",
            ],
        )
    with pytest.raises(ConfigError, match=r"task\.environment\.urls"):
        load_config(
            None, ["task.type=arithmetic", "task.environment={type: remote, urls: [host:1]}"]
        )


TURNS = """
import asyncio, sys
from asyncrl.environments import StepResult

class Custom(BaseException):
    pass

RAISES = {
    "exit": lambda: sys.exit(3),
    "cancel": asyncio.CancelledError,
    "keyboard": KeyboardInterrupt,
    "generator": GeneratorExit,
    "custom": Custom,
}

class Turns:
    def __init__(self, mode="ok"):
        self.mode, self.turn = mode, 0

    async def reset(self, item):
        if item.prompt_id != "12+34":  # the scheduler's other groups go on as usual
            self.mode = "ok"
        return "5" * 20000 if self.mode == "flood_first" else "9="

    async def step(self, response):
        self.turn += 1
        if self.mode in RAISES:
            raise RAISES[self.mode]()
        if self.mode == "exit_later":  # past every guard: a callback of its own
            asyncio.get_running_loop().call_soon(sys.exit, 3)
        if self.mode == "stop_loop":
            asyncio.get_running_loop().stop()
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "flood":
            return StepResult("5" * 20000, done=False)
        if self.mode == "bad":
            return 42
        if self.turn == 1:
            return StepResult("<bos>5+6=", done=False)
        return StepResult(None, done=True)  # scored by the task: its reward on the last turn

    async def close(self):
        pass
"""


class _Scripted:
    """Answers "46<eos>" at `version`; `longest` is the longest context it was given."""

    def __init__(self) -> None:
        self.version = 3
        self.longest = 0

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        import numpy as np

        from asyncrl.engines.base import Generation

        self.longest = max([self.longest, *map(len, prompts)])
        reply = [7, 9, 2]
        return [
            Generation(
                np.array(reply, np.int32),
                np.full(3, -0.5, np.float32),
                np.full(3, self.version, np.int32),
                "stop",
            )
            for _ in prompts
        ]


def _scheduler(
    tmp_path: Path,
    mode: str,
    errors: list[str],
    max_context: int | None = None,
    engine: _Scripted | None = None,
) -> Any:
    from asyncrl.engines.config import SamplingParams
    from asyncrl.environments.config import PythonEnvironmentConfig
    from asyncrl.rollout.scheduler import EpisodeScheduler
    from asyncrl.tasks.base import ArithmeticTask, WithEnvironment
    from asyncrl.tasks.build import build_environments
    from asyncrl.tasks.config import ArithmeticTaskConfig
    from asyncrl.tiny_model import build_tokenizer

    (tmp_path / "turns_env.py").write_text(textwrap.dedent(TURNS))
    tok = build_tokenizer()
    cfg = PythonEnvironmentConfig(
        path="turns_env:Turns", python_path=[str(tmp_path)], kwargs={"mode": mode}, timeout_s=0.5
    )
    task = WithEnvironment(
        ArithmeticTask(ArithmeticTaskConfig(eval_size=1, train_size=1), tok),
        build_environments(cfg),
    )
    return EpisodeScheduler(
        engine or _Scripted(),
        task,
        tok,
        SamplingParams(max_new_tokens=4),
        max_context=max_context,
        on_env_error=errors.append,
    )


def _drive(sched: Any, timeout_s: float = 20) -> tuple[list[Any], list[Any]]:
    finished: list[Any] = []
    failed: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while sched.inflight:
        assert time.monotonic() < deadline, "episodes did not end"
        f, x = sched.advance(0.05)
        finished += f
        failed += x
    sched.close()
    return finished, failed


def test_a_python_environment_drives_the_episode_hand_worked(tmp_path: Path) -> None:
    errors: list[str] = []
    sched = _scheduler(tmp_path, "ok", errors)
    sched.start("g", ITEM, 2, "g")
    (group,), failed = _drive(sched)
    assert not failed and not errors
    first, answer, obs = [12, 14], [7, 9, 2], [1, 8, 13, 9, 14]  # "9=", "46<eos>", "<bos>5+6="
    for s in group.samples:
        assert s.response_ids.tolist() == first + answer + obs + answer
        assert s.loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
        # The first observation takes the first turn's version: none is known before it.
        assert s.versions.tolist() == [3] * 13
        assert s.logprobs.tolist() == [0, 0, -0.5, -0.5, -0.5, 0, 0, 0, 0, 0, -0.5, -0.5, -0.5]
        assert s.reward == 1.0  # the task's exact-match reward of the last turn, "46"
        assert s.meta == {"turns": 2}


@pytest.mark.parametrize(("mode", "reason"), [("hang", "timeout"), ("bad", "malformed")])
def test_a_python_environment_past_its_timeout_or_malformed_fails_its_group(
    tmp_path: Path, mode: str, reason: str
) -> None:
    errors: list[str] = []
    sched = _scheduler(tmp_path, mode, errors)
    sched.start("g", ITEM, 2, "g")
    finished, failed = _drive(sched)
    assert not finished and [(f.tag, f.reason) for f in failed] == [("g", f"env_{reason}")]
    assert errors[0] == reason and sched.inflight == 0


OTHER = PromptItem("1+2", "1+2=", [1, 4, 13, 5, 14], "3")


@pytest.mark.parametrize(
    ("mode", "raised"),
    [
        ("exit", "SystemExit: 3"),
        ("cancel", "CancelledError"),
        ("keyboard", "KeyboardInterrupt"),
        ("generator", "GeneratorExit"),
        ("custom", "Custom"),
    ],
)
def test_an_environment_raising_any_base_exception_fails_its_group_and_the_rest_go_on(
    tmp_path: Path, mode: str, raised: str
) -> None:
    """`sys.exit()`, a CancelledError of its own, any BaseException from an environment's
    code is its group's `env_error`, not the end of the scheduler's event loop or a step that
    never returns."""
    errors: list[str] = []
    sched = _scheduler(tmp_path, mode, errors)
    sched.start("g", ITEM, 2, "g")
    sched.start("h", OTHER, 2, "h")
    finished, failed = _drive(sched)
    assert [(f.tag, f.reason) for f in failed] == [("g", "env_error")]
    assert failed[0].detail.startswith(f"step raised {raised}"), failed[0].detail
    assert [g.tag for g in finished] == ["h"] and errors == ["error"]


@pytest.mark.parametrize(
    ("mode", "said"), [("exit_later", "died of SystemExit: 3"), ("stop_loop", "was stopped")]
)
def test_an_event_loop_ended_past_every_guard_stops_the_scheduler_at_once(
    tmp_path: Path, mode: str, said: str
) -> None:
    """User code that ends the loop from a callback of its own, where no guard reaches: the
    generating thread learns it from the next `advance`, which would otherwise wait forever
    for steps that never return."""
    from asyncrl.rollout.env_loop import EnvironmentLoopDied

    sched = _scheduler(tmp_path, mode, [])
    sched.start("g", ITEM, 2, "g")
    deadline = time.monotonic() + 20
    with pytest.raises(EnvironmentLoopDied, match=said):
        while time.monotonic() < deadline:
            sched.advance(0.05)
    with pytest.raises(EnvironmentLoopDied):  # and every later call, not only the first
        sched.advance(0.05)
    sched.close()


def test_an_observation_past_the_context_bound_ends_the_episode_as_truncated(
    tmp_path: Path,
) -> None:
    """A 20,000-token observation for a 128-position model: the episode ends before it is
    prefilled, its first turn kept and scored by the task, as `length`; the engine never sees
    a context its next turn would take past the bound."""
    engine = _Scripted()
    sched = _scheduler(tmp_path, "flood", [], max_context=128, engine=engine)
    sched.start("g", ITEM, 2, "g")
    sched.start("h", OTHER, 2, "h")
    finished, failed = _drive(sched)
    assert not failed
    by_tag = {g.tag: g for g in finished}
    for s in by_tag["g"].samples:
        assert s.response_ids.tolist() == [12, 14, 7, 9, 2]  # "9=", the first turn "46<eos>"
        assert s.loss_mask.tolist() == [0, 0, 1, 1, 1]
        assert (s.finish, s.reward, s.meta) == ("length", 1.0, {"turns": 1})
    assert all(len(s.response_ids) == 13 for s in by_tag["h"].samples)  # two turns, as usual
    assert engine.longest <= 128 - 4


def test_a_first_turn_past_the_context_bound_fails_its_group_with_the_reason(
    tmp_path: Path,
) -> None:
    """Nothing generated yet, nothing to keep: the group fails, by rule and with the reason; a
    plain task's prompt too long for the bound fails the same way."""
    engine = _Scripted()
    sched = _scheduler(tmp_path, "flood_first", [], max_context=128, engine=engine)
    sched.start("g", ITEM, 2, "g")
    finished, failed = _drive(sched)
    assert not finished and [(f.tag, f.reason) for f in failed] == [("g", "context_too_long")]
    assert failed[0].detail == (
        "20007 tokens of prompt and first observation and 4 new ones pass the 128 positions"
    )
    assert engine.longest == 0


def test_a_plain_prompt_past_the_context_bound_fails_its_group() -> None:
    from asyncrl.engines.config import SamplingParams
    from asyncrl.rollout.scheduler import EpisodeScheduler
    from asyncrl.tasks.base import ArithmeticTask
    from asyncrl.tasks.config import ArithmeticTaskConfig
    from asyncrl.tiny_model import build_tokenizer

    tok = build_tokenizer()
    task = ArithmeticTask(ArithmeticTaskConfig(eval_size=1, train_size=1), tok)
    engine = _Scripted()
    sched = EpisodeScheduler(engine, task, tok, SamplingParams(max_new_tokens=4), max_context=10)
    sched.start("long", ITEM, 2, "long")  # 7 prompt tokens + 4 new: 11
    sched.start("short", PromptItem("1+2", "1+2=", [1, 4, 13, 5, 14], "3"), 2, "short")
    finished, failed = _drive(sched)
    assert [(f.tag, f.reason) for f in failed] == [("long", "context_too_long")]
    assert [g.tag for g in finished] == ["short"] and engine.longest == 5


def _remote_scheduler(url: str, timeout_s: float = 60.0) -> Any:
    """A scheduler whose episodes hold sessions on the env-server at `url`."""
    from asyncrl.engines.config import SamplingParams
    from asyncrl.rollout.scheduler import EpisodeScheduler
    from asyncrl.tasks.base import ArithmeticTask, WithEnvironment
    from asyncrl.tasks.build import build_environments
    from asyncrl.tasks.config import ArithmeticTaskConfig
    from asyncrl.tiny_model import build_tokenizer

    tok = build_tokenizer()
    task = WithEnvironment(
        ArithmeticTask(ArithmeticTaskConfig(eval_size=1, train_size=1), tok),
        build_environments(RemoteEnvironmentConfig(urls=[url], timeout_s=timeout_s)),
    )
    return EpisodeScheduler(_Scripted(), task, tok, SamplingParams(max_new_tokens=4))


def _advance_until(sched: Any, cond: Any, what: str) -> list[Any]:
    failed: list[Any] = []
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, what
        failed += sched.advance(0.02)[1]
    return failed


def test_closing_the_scheduler_closes_the_sessions_of_episodes_cut_short(env_dir: Path) -> None:
    """A hard stop: episodes whose steps hang on the server are cancelled, and every session
    is closed there (the environment's `close` ran, the server holds none)."""
    s = Served(env_dir, kwargs={"sleep_s": 3600, "silent": True})
    import user_envs  # the same module object the server imported

    user_envs.Echo.closed = user_envs.Echo.live = 0
    try:
        sched = _remote_scheduler(s.url)
        sched.start("g", ITEM, 3, "g")
        sched.start("h", ITEM, 3, "h")
        _advance_until(sched, lambda: user_envs.Echo.live == 6, "6 steps hanging on the server")
        assert s.health()["sessions"] == 6
        sched.close()
        assert (s.health()["sessions"], user_envs.Echo.closed) == (0, 6)
        assert sched.inflight == 6  # nothing ended: the groups are not handed back
    finally:
        s.stop()


def test_a_failed_group_closes_its_sessions(env_dir: Path) -> None:
    """Steps past the client's timeout fail the group, and each of its sessions is closed as
    its step comes back (the scheduler goes on advancing), not only when it is closed."""
    s = Served(env_dir, kwargs={"sleep_s": 3600, "silent": True})
    import user_envs  # the same module object the server imported

    user_envs.Echo.closed = 0
    try:
        sched = _remote_scheduler(s.url, timeout_s=0.3)
        sched.start("g", ITEM, 3, "g")
        (failed,) = _advance_until(sched, lambda: not sched.inflight, "the group failing")
        assert failed.reason == "env_timeout"
        # Ended by the server at the deadline the client sent, or by the client's DELETE:
        # either way each environment is closed once (the server's close runs after the reply).
        _advance_until(sched, lambda: s.health()["sessions"] == 0, "sessions ended")
        _advance_until(sched, lambda: user_envs.Echo.closed >= 3, "sessions closed")
        assert user_envs.Echo.closed == 3
        sched.close()
    finally:
        s.stop()


@pytest.mark.timeout(300)
def test_a_second_sigterm_stops_a_worker_and_closes_its_sessions(
    env_dir: Path, redis_client: Any, random_model: Path, role_config: Any, tmp_path: Path
) -> None:
    """A rollout worker told to stop twice leaves without finishing its episodes, which hang
    in their tool: every session is deleted at the env-server, its prompts stay pending."""
    from asyncrl.runstate import Keys

    from role_procs import Role, arithmetic_admission, pending_prompts, stop_all

    closes = tmp_path / "closed.log"
    server = Process(env_dir, {"sleep_s": 3600, "silent": True, "close_log": str(closes)})
    keys = Keys("hardstop")
    config = role_config(
        keys.run_id,
        {
            "rollout.prompts_per_batch": 2,
            "task.type": "arithmetic",
            "task.environment": {"type": "remote", "urls": [server.url]},
        },
    )
    admission = arithmetic_admission(redis_client, keys, random_model, n=2, max_staleness=1)
    worker = Role("rollout", config, tmp_path / "rollout.log", "--worker-id", "A")
    try:
        wait_until(
            lambda: bool(redis_client.exists(keys.worker("rollout", "A"))),
            180,
            "the worker starting",
            [worker],
        )
        assert admission.release(step=0, version=0) == 2
        wait_until(lambda: server.health()["sessions"] == 4, 60, "4 sessions open", [worker])
        # The first SIGTERM drains (the steps never return); a later one stops the worker.
        while worker.alive():
            worker.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.wait(1.0)
        assert worker.proc.returncode == 0, worker.tail()
        assert server.health()["sessions"] == 0
        assert closes.read_text().count("closed") == 4
        assert len(pending_prompts(redis_client, keys, "A")) == 2  # delivered again later
        assert redis_client.xlen(keys.trajectories) == 0
    finally:
        stop_all([worker])
        server.stop()
