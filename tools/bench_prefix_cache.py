"""One rollout worker's episodes on the agentic task, prefix cache off against on, side by side.

    python tools/bench_prefix_cache.py [--config configs/agentic.yaml] [--groups 120]
                                       [--seconds 20] [--swap-every 0.75] [--repeats 2]

No trainer and no Redis: the worker's episode scheduler and builtin engine, in this process,
keep `--groups` groups in flight (a finished group is replaced at once) for `--seconds`, while
a thread stages a copy of the weights as a new version every `--swap-every` seconds (what the
trainer's publishing does to a worker). Modes, interleaved `--repeats` times: `off` (no cache),
`fresh` (cache; a swap drops keys of older weights), `stale` (cache; keys survive swaps). With
the in-flight count fixed, Little's law makes the mean group duration the figure: the smaller,
the more groups per second a worker turns over. `reused` = prompt tokens served from the cache /
all prompt tokens. The last line is JSON: medians per mode and the ratios to `off`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from transformers import AutoTokenizer

from asyncrl.config import load_config
from asyncrl.model import ensure_model
from asyncrl.rollout.backends import build_engine
from asyncrl.rollout.scheduler import EpisodeScheduler
from asyncrl.rollout.turns import GenerateCall
from asyncrl.tasks.build import build_task

MODES = {
    "off": ["rollout.engine.prefix_cache_tokens=0"],
    "fresh": ["rollout.engine.prefix_cache_stale=false"],
    "stale": ["rollout.engine.prefix_cache_stale=true"],
}


def run(config: str, overrides: list[str], groups: int, seconds: float, swap_s: float) -> dict:
    cfg = load_config(config, overrides)
    model_dir = ensure_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = build_task(cfg.task, tokenizer)
    engine = build_engine(cfg.rollout.engine, model_path=str(model_dir))
    calls: list[GenerateCall] = []

    episodes: EpisodeScheduler[int] = EpisodeScheduler(
        engine,
        task,
        tokenizer,
        cfg.rollout.sampling,
        batch_wait_s=cfg.rollout.turn_batch_wait_s,
        on_generate=calls.append,
    )
    stop = threading.Event()
    weights = {k: t.clone() for k, t in engine.state_dict_for_sync().items()}

    def publish() -> None:
        version = 0
        while not stop.wait(swap_s):
            version += 1
            engine.stage_weights({k: t.clone() for k, t in weights.items()}, version)

    threading.Thread(target=publish, daemon=True).start()
    items = task.train_items(cfg.run.seed, 0)
    n = cfg.rollout.n
    started = 0
    for started in range(groups):
        episodes.start(started, items[started], n, f"g{started}")
    durations: list[float] = []
    t0 = time.time()
    while time.time() - t0 < seconds:
        finished, _ = episodes.advance(0.01)
        for group in finished:
            durations.append(time.time() - group.created_at)
            started += 1
            episodes.start(started, items[started % len(items)], n, f"g{started}")
    elapsed = time.time() - t0
    stop.set()
    episodes.close()
    return {
        "mean_group_s": statistics.fmean(durations),
        "groups_per_s": len(durations) / elapsed,
        "generating_fraction": sum(c.seconds for c in calls) / elapsed,
        "reused": sum(c.cached_tokens for c in calls) / sum(c.prompt_tokens for c in calls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/agentic.yaml")
    ap.add_argument("--groups", type=int, default=120, help="groups in flight")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--swap-every", type=float, default=0.75)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)  # as the launcher runs each role (OMP_NUM_THREADS=1)
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode, overrides in MODES.items():
            r = run(args.config, overrides, args.groups, args.seconds, args.swap_every)
            print(mode, json.dumps({k: round(v, 3) for k, v in r.items()}), flush=True)
            results[mode].append(r)
    medians = {
        mode: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
        for mode, rs in results.items()
    }
    off = medians["off"]["mean_group_s"]
    print(
        json.dumps(
            {
                **medians,
                "group_time_ratio_fresh": round(medians["fresh"]["mean_group_s"] / off, 3),
                "group_time_ratio_stale": round(medians["stale"]["mean_group_s"] / off, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
