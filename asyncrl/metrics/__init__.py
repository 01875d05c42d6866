"""Prometheus metrics of every asyncrl process, the run's JSONL metrics log and the experiment
trackers fed beside it (DESIGN §8).

- `config`: `metrics.*` (endpoint, JSONL log, trackers);
- `table`: every metric, one row each (name, kind, labels, help, the step-record field it is set
  from); `docs/metrics.md` is generated from it;
- `roles`: the families generated from the table, and `RoleMetrics`, one process' bindings;
- `record`: `StepRecord` / `EvalRecord`, the typed lines of `metrics.jsonl` and `last_step`;
- `jsonl`: writing and reading `metrics.jsonl`;
- `poller`: the run-wide gauges read from Redis (`RunGauges`);
- `server`: the `/metrics` and `/healthz` endpoint;
- `trackers`: W&B, TensorBoard and MLflow, fed the records of the JSONL log (`TrackerFeed`).
"""
