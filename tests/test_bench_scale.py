"""tools/bench_scale.py's smallest slice runs end to end, so that the ladder cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).parent.parent / "tools" / "bench_scale.py"


def test_the_smallest_broadcast_slice_reports_both_sides() -> None:
    cmd = [sys.executable, str(TOOL), "--sizes", "1m", "--parts", "broadcast", "--rounds", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    row = result["sizes"]["1m"]["broadcast"]
    assert row["params"] > 1_000_000
    # fp32 engine: every byte of the fp32 parameters goes, padded to the layout's alignment.
    assert row["param_mb"] <= row["wire_mb"] < row["param_mb"] * 1.01
    assert row["sync_s"] > 0 and row["raw_s"] > 0 and row["blocking_s"] > 0
    assert row["receiver_rss_mb"] >= row["receiver_model_mb"] > 0
