"""``python -m fxshard demo``: 2 gloo ranks train a tensor-parallel Llama and compare
every step's loss with one device."""
from __future__ import annotations

import re
import subprocess
import sys

ROW = re.compile(r"^\s*(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(\d\.\d+e[+-]\d+)\s*$")
SUMMARY = re.compile(r"max \|loss difference\| over (\d+) SGD steps: (\S+)")


def test_demo_two_steps():
    run = subprocess.run([sys.executable, "-m", "fxshard", "demo", "--steps", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"demo failed (exit {run.returncode}):\n{run.stdout}\n{run.stderr}"
    out = run.stdout
    assert "fxshard dump of" in out and "fxshard.all_reduce" in out, out  # the dump of one layer
    assert re.search(r"step\s+fxshard loss\s+1-device loss\s+\|diff\|", out), out
    rows = [ROW.match(line) for line in out.splitlines()]
    rows = [m for m in rows if m]
    assert [int(m[1]) for m in rows] == [0, 1], out
    diffs = []
    for m in rows:
        sharded, single, diff = float(m[2]), float(m[3]), float(m[4])
        assert 0 < single < 20, out  # a real cross-entropy over 128 classes
        assert abs(abs(sharded - single) - diff) < 2e-6, out  # the |diff| column says what it shows
        diffs.append(abs(sharded - single))
    summary = SUMMARY.search(out)
    assert summary is not None and int(summary[1]) == 2, out
    assert float(summary[2]) < 1e-4, out
    assert max(diffs) < 1e-4, out
