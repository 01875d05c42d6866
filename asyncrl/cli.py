"""`asyncrl` command line. Parses first, imports the heavy parts late: `--help` stays instant."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from asyncrl import __version__

if TYPE_CHECKING:
    from asyncrl.config import Config


def _token_options(parser: argparse.ArgumentParser, env: str) -> None:
    """A server's `--token-env` / `--token-file`: where its run's shared secret is."""
    parser.add_argument(
        "--token-env",
        default=env,
        metavar="NAME",
        help="environment variable holding the run's shared secret (required off loopback)",
    )
    parser.add_argument("--token-file", metavar="PATH", help="file holding it (wins)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncrl",
        description="Asynchronous RL post-training: rollout and trainer pools joined by Redis.",
    )
    parser.add_argument("--version", action="version", version=f"asyncrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    launch = sub.add_parser(
        "launch",
        help="run a role: trainer, rollout, or all (local mode)",
        description="Run one role of a run. Overrides are dotted key=value pairs.",
    )
    launch.add_argument("--role", required=True, choices=["trainer", "rollout", "all"])
    launch.add_argument("--config", help="YAML config file (defaults apply when omitted)")
    launch.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="e.g. run.id=exp1")
    launch.add_argument("--mode", choices=["async", "sync"], help="shorthand for run.mode=...")
    launch.add_argument("--print-config", action="store_true", help="print the resolved config")
    launch.add_argument("--fresh", action="store_true", help="all: discard the run dir's state")
    launch.add_argument("--worker-id", help="rollout: stable id (default: host-pid)")
    launch.add_argument(
        "--progress",
        choices=["live", "quiet", "json"],
        default=None,
        help="all: live table (default on a terminal), quiet, or one JSON line per step",
    )
    launch.add_argument("--launcher", choices=["local", "ray"], default="local")
    launch.add_argument("--ray-address", help="ray: address of an existing cluster")
    launch.add_argument(
        "--trainer-ranks", type=int, metavar="N", help="all: shorthand for trainer.ranks=N"
    )

    status = sub.add_parser("status", help="show a run: version, queues, workers, last step")
    status.add_argument("--config", help="the run's config (for run.id and redis.url)")
    status.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    status.add_argument("--json", action="store_true", help="stable JSON object (see README)")

    serve = sub.add_parser(
        "serve",
        help="serve a model over SGLang's HTTP API with the builtin engine (CPU tests)",
        description="The builtin torch engine behind SGLang's HTTP API: /generate, weight "
        "updates, pause/continue. Binds to loopback unless told otherwise; it has no auth.",
    )
    serve.add_argument("--engine", choices=["torch"], default="torch")
    serve.add_argument("--model", required=True, help="Hugging Face model directory")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=30000, help="0 picks a free port")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    serve.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    serve.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="record each token's experts for requests with return_routed_experts (MoE models)",
    )

    env_server = sub.add_parser(
        "env-server",
        help="serve an Environment class over HTTP/JSON (task.environment.type: remote)",
        description="One Environment instance per session behind a versioned HTTP/JSON "
        "protocol (asyncrl.environments.server). Every call needs the run's token "
        "(--token-env); without one it binds to loopback only.",
    )
    env_server.add_argument("--env", required=True, help='"package.module:Class"')
    env_server.add_argument("--kwargs", default="{}", help="JSON object: the class's kwargs")
    env_server.add_argument("--python-path", action="append", default=[], metavar="DIR")
    env_server.add_argument("--host", default="127.0.0.1")
    env_server.add_argument("--port", type=int, default=8300, help="0 picks a free port")
    env_server.add_argument("--max-sessions", type=int, default=1024, help="open sessions at most")
    env_server.add_argument(
        "--idle-timeout-s",
        type=float,
        default=1800.0,
        help="close a session no call has used for this long: its worker is gone (0: never)",
    )
    _token_options(env_server, "ASYNCRL_ENV_SERVER_TOKEN")
    env_server.add_argument(
        "--max-body-bytes", type=int, default=4 << 20, help="largest request body (4 MiB)"
    )
    env_server.add_argument(
        "--max-connections", type=int, default=4096, help="open connections at most"
    )
    env_server.add_argument(
        "--read-timeout-s",
        type=float,
        default=30.0,
        help="a request must arrive whole this soon after its first byte",
    )

    agent_server = sub.add_parser(
        "agent-server",
        help="run an agent per request over HTTP/JSON (task.agent.type: remote)",
        description="An agent runner: a python agent (--agent) or a command (after --), run "
        "once per episode against the rollout worker's gateway (asyncrl.agents.runner). "
        "Every call needs the run's token (--token-env); without one it binds to loopback only.",
    )
    agent_server.add_argument("--agent", help='"package.module:fn", a python agent')
    agent_server.add_argument("--kwargs", default="{}", help="JSON object: the agent's kwargs")
    agent_server.add_argument("--python-path", action="append", default=[], metavar="DIR")
    agent_server.add_argument("--host", default="127.0.0.1")
    agent_server.add_argument("--port", type=int, default=8400, help="0 picks a free port")
    agent_server.add_argument(
        "--max-episodes", type=int, default=256, help="episodes running at once at most"
    )
    _token_options(agent_server, "ASYNCRL_AGENT_SERVER_TOKEN")
    agent_server.add_argument("argv", nargs="*", help="-- a command agent and its arguments")

    plot = sub.add_parser("plot", help="write PNG curves from a run's metrics.jsonl")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="output folder (default RUN_DIR/plots)")

    doctor = sub.add_parser(
        "doctor",
        help="name a run's bottleneck and the config change for it, from its time breakdown",
    )
    doctor.add_argument("run_dir")

    mismatch = sub.add_parser(
        "mismatch", help="print a run's train/inference mismatch table and plot it"
    )
    mismatch.add_argument("run_dir")
    mismatch.add_argument("--out", help="output folder (default RUN_DIR/plots)")
    mismatch.add_argument("--steps", type=int, default=0, help="only the last N steps (0: all)")

    export = sub.add_parser(
        "export",
        help="write a run's trained model: a LoRA adapter (peft) or a Hugging Face model",
    )
    export.add_argument("run_dir")
    export.add_argument("--merge", action="store_true", help="LoRA: fold the adapter into the base")
    export.add_argument("--out", help="output folder (default RUN_DIR/export)")
    return parser


def _load(args: argparse.Namespace) -> Config:
    from asyncrl.config import load_config

    overrides = list(args.overrides)
    if getattr(args, "mode", None):
        overrides.append(f"run.mode={args.mode}")
    if getattr(args, "trainer_ranks", None) is not None:
        overrides.append(f"trainer.ranks={args.trainer_ranks}")
    return load_config(args.config, overrides)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    # Overrides may follow options (`--mode sync trainer.max_steps=5`), which a plain
    # positional nargs="*" does not accept: collect stray key=value words here.
    args, extra = parser.parse_known_args(argv)
    stray = [w for w in extra if "=" in w and not w.startswith("-")]
    if len(stray) != len(extra) or (stray and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(w for w in extra if w not in stray)}")
    if stray:
        args.overrides = [*args.overrides, *stray]
    from asyncrl.config import ConfigError

    try:
        if args.command == "launch":
            cfg = _load(args)
            if args.print_config:
                from asyncrl.config import dump_yaml

                sys.stdout.write(dump_yaml(cfg))
                return 0
            from asyncrl.launch.roles import launch

            return launch(cfg, args)
        if args.command == "status":
            from asyncrl.launch.status import main as status_main

            return status_main(_load(args), as_json=args.json)
        if args.command == "serve":
            from asyncrl.serve.server import main as serve_main

            return serve_main(args)
        if args.command == "env-server":
            from asyncrl.environments.server import main as env_server_main

            return env_server_main(args)
        if args.command == "agent-server":
            from asyncrl.agents.runner import main as agent_server_main

            return agent_server_main(args)
        if args.command == "plot":
            from asyncrl.plot import main as plot_main

            return plot_main(args.run_dir, args.out)
        if args.command == "doctor":
            from asyncrl.doctor import main as doctor_main

            return doctor_main(args.run_dir)
        if args.command == "mismatch":
            from asyncrl.mismatch_report import main as mismatch_main

            return mismatch_main(args.run_dir, args.out, args.steps)

        if args.command == "export":
            from asyncrl.export import main as export_main

            return export_main(args.run_dir, args.out, args.merge)
    except ConfigError as exc:
        print(f"asyncrl: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
