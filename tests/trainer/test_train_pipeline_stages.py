"""``python -m fxshard train --mesh pp=2,dp=2`` on 8 blocks holds blocks 0-3 and 4-7, as
``--mesh pp=2`` does: FSDP2 splits each block out of the program, and the stages are
balanced by what the blocks cost (``fxshard.pipelining.stage_costs``), not by their outputs
(before, the cut put blocks 0-6 on the first stage and 7 alone on the last)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = os.path.join(ROOT, "examples", "data", "genesis.txt")


def test_pp2_dp2_holds_half_the_blocks_per_stage(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "fxshard", "train",
           "--model", "llama", "--model-config", "hidden_size=64,num_hidden_layers=8", "--data", TEXT,
           "--data-cache", str(tmp_path), "--steps", "1", "--batch", "8", "--seq", "32", "--microbatches", "2",
           "--mesh", "pp=2,dp=2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    holds = re.search(r"^holds: (.*)$", done.stdout, re.M)
    assert holds, done.stdout[-3000:]
    # ranks 0, 1 (pp=0) hold the first stage, ranks 2, 3 (pp=1) the second
    spans = re.findall(r"rank (\d) blocks (\S+) params", holds.group(1))
    assert spans == [("0", "0-3"), ("1", "0-3"), ("2", "4-7"), ("3", "4-7")], holds.group(1)
