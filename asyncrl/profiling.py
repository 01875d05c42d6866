"""On-demand `torch.profiler` traces of chosen steps of one role (config `profile`).

A trace is Chrome trace-event JSON (`{run.dir}/profile/{role}-{worker}-step{N}.json`): open it in
Perfetto (ui.perfetto.dev), chrome://tracing or TensorBoard's profiler. Off by default; off, a
step costs one set lookup (`StepProfiler.step` hands back a shared no-op), and torch.profiler
is imported only when a chosen step comes. What a step is: the trainer's optimizer step
(1 = the first of the run), a rollout worker's turn of its loop over episodes in flight (one
`EpisodeScheduler.advance`: returned environment steps taken back, one engine call over the
ready episodes; 1 = its first).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from asyncrl.configbase import Section

if TYPE_CHECKING:
    from torch.profiler import ProfilerActivity

log = logging.getLogger(__name__)

Activity = Literal["cpu", "cuda", "npu"]
_EVERY: list[Activity] = ["cpu", "cuda", "npu"]


class ProfileConfig(Section):
    """`torch.profiler` traces of chosen steps of one role, into `{run.dir}/profile/`."""

    role: Literal["none", "trainer", "rollout"] = "none"
    """The role whose steps are traced (every process of it); `none`: no trace."""
    steps: list[int] = Field(default_factory=lambda: [3])
    """Steps to trace, one trace file each: the trainer's optimizer steps, or a rollout
    worker's turns of its loop over episodes in flight, counted from 1 (the first ones
    include warm-up)."""
    activities: list[Activity] = Field(default_factory=lambda: list(_EVERY))
    """What to record: host operators, and the CUDA or Ascend NPU kernels where such a
    device is present (an absent one is left out)."""


_OFF = contextlib.nullcontext()


class StepProfiler:
    """Traces the steps `cfg` chooses for `role` (see the module)."""

    def __init__(self, cfg: ProfileConfig, role: str, worker: str, run_dir: Path) -> None:
        self.steps = frozenset(cfg.steps) if cfg.role == role else frozenset()
        self.activities = cfg.activities
        self.prefix = f"{role}-{worker}"
        self.out = run_dir / "profile"

    def step(self, n: int) -> contextlib.AbstractContextManager[object]:
        """The context to run step `n` in: a trace of it when chosen, else nothing."""
        return self._trace(n) if n in self.steps else _OFF

    @contextlib.contextmanager
    def _trace(self, n: int) -> Iterator[None]:
        import torch.profiler as tp

        with (
            tp.profile(activities=_present(self.activities), record_shapes=True) as prof,
            tp.record_function(f"{self.prefix} step {n}"),
        ):
            yield
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{self.prefix}-step{n}.json"
        prof.export_chrome_trace(str(path))
        log.info("profile: step %d traced to %s", n, path)


def _present(wanted: list[Activity]) -> list[ProfilerActivity]:
    """The profiler activities of `wanted` this process can record."""
    import torch
    from torch.profiler import ProfilerActivity

    have = {"cpu": ProfilerActivity.CPU}
    if torch.cuda.is_available():
        have["cuda"] = ProfilerActivity.CUDA
    privateuse = getattr(ProfilerActivity, "PrivateUse1", None)
    if privateuse is not None and hasattr(torch, "npu") and torch.npu.is_available():
        have["npu"] = privateuse  # torch_npu registers the Ascend NPU as the PrivateUse1 device
    return [have[a] for a in wanted if a in have] or [ProfilerActivity.CPU]
