"""`asyncrl launch`: run one role in this process, or a whole local run (`--role all`)."""

from __future__ import annotations

import argparse
import logging
import sys

from asyncrl.config import Config


def setup_logging(name: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def launch(cfg: Config, args: argparse.Namespace) -> int:
    from asyncrl.metrics.trackers import missing_package
    from asyncrl.model import missing_model
    from asyncrl.tasks.gym import check_task
    from asyncrl.tasks.verifiers import check_verifiers

    # Before any Redis is reached or started: a wrong path or dataset name is a config error,
    # not an outage.
    problem = (
        missing_model(cfg)
        or check_task(cfg.task)
        or check_verifiers(cfg.task)
        or missing_package(cfg.metrics.trackers)
    )
    if problem is None and cfg.model.lora is not None:
        from asyncrl.lora import resume_mismatch

        problem = resume_mismatch(cfg)
    if problem is not None:
        print(f"asyncrl: config error: {problem}", file=sys.stderr)
        return 2
    if args.role == "all":
        if args.launcher == "ray":
            from asyncrl.launch.ray_launcher import run_ray

            return run_ray(cfg, args)
        from asyncrl.launch.local import run_local

        return run_local(cfg, args)
    if cfg.redis.url is None:
        print(
            f"asyncrl: config error: redis.url: required for --role {args.role} "
            "(only --role all starts an embedded Redis)",
            file=sys.stderr,
        )
        return 2
    name = "trainer" if args.role == "trainer" else f"rollout[{args.worker_id or ''}]"
    setup_logging(name)
    from asyncrl.redis_conn import RedisAccessError, connect, wait_until_reachable

    # A role may start before Redis does; a refused password or certificate ends it at once.
    try:
        client = connect(cfg.redis)
        wait_until_reachable(client, cfg.redis)
        client.close()
    except RedisAccessError as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2
    from redis.exceptions import NoPermissionError

    from asyncrl.model_identity import ModelMismatch

    try:
        return _run_role(cfg, args)
    except ModelMismatch as exc:
        print(f"asyncrl: {exc}", file=sys.stderr)
        return 2
    except NoPermissionError as exc:
        print(
            f"asyncrl: redis: the ACL refused this user: {exc} (SECURITY.md, 'Redis ACL for a "
            "run', lists what a run needs)",
            file=sys.stderr,
        )
        return 2


def _run_role(cfg: Config, args: argparse.Namespace) -> int:
    if args.role == "trainer":
        from asyncrl.lease import LeaseError
        from asyncrl.trainer.checkpoint import CheckpointError
        from asyncrl.trainer.main import run_trainer

        try:
            return run_trainer(cfg)
        except CheckpointError as exc:
            print(
                f"asyncrl: trainer: {exc}; the groups trained since stay pending and a "
                "restart trains them again",
                file=sys.stderr,
            )
            return 1
        except LeaseError as exc:  # a second trainer on the run: refused, or stopped
            print(f"asyncrl: trainer: run {cfg.run.id}: {exc}", file=sys.stderr)
            return 2
    from asyncrl.rollout.worker import run_worker

    return run_worker(cfg, args.worker_id)
