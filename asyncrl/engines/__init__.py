"""Rollout engines: the engine seam (`base`), the builtin torch engine, its configs and helpers."""
