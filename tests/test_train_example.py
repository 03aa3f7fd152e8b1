"""``examples/train.py``, the reference trainer, run as a user runs it: ``torchrun`` with 4
gloo ranks at dp x tp = 2 x 2 (FSDP2 over dp, HF's plan over tp), clipping at 0.1,
accumulation 2, AdamW with warmup + cosine.

* fp32: every step's loss equals the same script on one process (1e-5), the final
  parameters too (the checksum of the full state dict);
* bf16 autocast (fp32 parameters and reductions) against one process under bf16 autocast:
  within bf16 tolerance;
* a rank killed (SIGKILL) at a random step, the run restarted by ``torchrun
  --max-restarts=1``: it resumes from the last committed checkpoint and ends bit for bit
  where the uninterrupted run ends.
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "examples", "train.py")
STEPS = 12
COMMON = ["--model", "qwen3", "--steps", str(STEPS), "--clip", "0.1", "--accum", "2", "--seed", "3"]
DP_TP = ["--mesh", "dp=2,tp=2"]
TIMEOUT = 600


def _torchrun(args, nproc=4, restarts=0):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}", TRAIN, *args]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _parse(out: str):
    losses = {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss (\S+)$", out, re.M)}
    checksum = re.findall(r"^final checksum (\S+)$", out, re.M)
    assert checksum, f"no final checksum in:\n{out[-3000:]}"
    return losses, float(checksum[-1])


def _run(cmd) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=_env(), cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 4-rank fp32 run, with checkpoints every 2 steps (as the killed run writes them)."""
    ckpt = tmp_path_factory.mktemp("ckpt_uninterrupted")
    return _parse(_run(_torchrun(COMMON + DP_TP + ["--ckpt-dir", str(ckpt), "--ckpt-every", "2"])))


def test_dp_tp_equals_one_process(uninterrupted):
    losses, checksum = uninterrupted
    want, want_checksum = _parse(_run([sys.executable, TRAIN, *COMMON]))
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in want.items():
        assert abs(losses[step] - loss) <= 1e-5, (step, losses[step], loss)
    assert losses[STEPS] < losses[1] - 0.05, "the run does not learn: the comparison proves little"
    assert abs(checksum - want_checksum) <= 1e-6 * abs(want_checksum) + 1e-4, (checksum, want_checksum)


def test_bf16_within_bf16_tolerance():
    got, _ = _parse(_run(_torchrun(COMMON + DP_TP + ["--bf16"])))
    want, _ = _parse(_run([sys.executable, TRAIN, *COMMON, "--bf16"]))
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 3e-2 * abs(loss), (step, got[step], loss)


def test_killed_rank_resumes_bit_for_bit(uninterrupted, tmp_path):
    _, want_checksum = uninterrupted
    kill_after = random.Random(time.time_ns()).randint(3, STEPS - 2)
    cmd = _torchrun(COMMON + DP_TP + ["--ckpt-dir", str(tmp_path), "--ckpt-every", "2"], restarts=1)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
    lines, killed = [], None
    try:
        deadline = time.monotonic() + TIMEOUT
        for line in proc.stdout:
            lines.append(line)
            if killed is None and line.startswith(f"step {kill_after} loss"):
                workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                           if any(TRAIN in part for part in p.cmdline())]
                assert workers, "no worker processes found"
                victim = random.Random(kill_after).choice(workers)
                victim.send_signal(signal.SIGKILL)
                killed = victim.pid
            assert time.monotonic() < deadline, "timed out"
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(lines)
    assert killed is not None, f"never reached step {kill_after}:\n{out[-3000:]}"
    assert proc.returncode == 0, f"killed at step {kill_after}, the restarted run failed:\n{out[-5000:]}"
    resumed = re.findall(r"^resumed from \S+ at step (\d+)$", out, re.M)
    assert resumed and int(resumed[-1]) <= kill_after, f"killed after step {kill_after}; no resume:\n{out[-3000:]}"
    _, checksum = _parse(out)
    assert checksum == want_checksum, f"killed after step {kill_after}: checksum {checksum!r} != {want_checksum!r}"
