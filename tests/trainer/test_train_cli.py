"""``python -m fxshard train`` run as a user runs it: ``torchrun`` on real gloo processes, a
checkpoint directory written by ``save_pretrained`` with a tokenizer trained locally, the
shipped public-domain text (examples/data) with a held-out split.

* every mesh (dp x tp, pp x tp, pp x dp, cp x tp; ep and dp x ep on Qwen3-MoE and Mixtral, whose
  experts run as grouped GEMMs) trains to the losses of one
  process, step by step (fp32, 1e-5), evaluates, and ends at its checksum;
* so do full (the bare ``--activation-checkpointing``) and selective activation checkpointing;
* ``--mesh pp=2`` holds half the blocks per rank; ``--mesh foo=2`` is refused before any work;
* the export loads in transformers with the trained program's logits (and loss under pp);
* a rank killed mid-run resumes, data position included, to the uninterrupted checksum.

The refusals and one-process flag checks are in ``test_train_flags.py``.
"""
from __future__ import annotations

import json
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = os.path.join(ROOT, "examples", "data", "genesis.txt")
HELD_OUT = os.path.join(ROOT, "examples", "data", "genesis.eval.txt")
STEPS = 6
TIMEOUT = 600


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _cmd(nproc: int, args: list[str], restarts: int = 0) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "fxshard", "train", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}", "-m", "fxshard", "train", *args]


def _run(nproc: int, args: list[str]) -> str:
    done = subprocess.run(_cmd(nproc, args), capture_output=True, text=True, timeout=TIMEOUT, env=_env(), cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _records(log_dir) -> tuple[dict[int, dict], dict[int, float]]:
    train, evals = {}, {}
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "eval_loss" in rec:
                evals[rec["step"]] = rec["eval_loss"]
            else:
                train[rec["step"]] = rec
    return train, evals


def _checksum(out: str) -> float:
    found = re.findall(r"^final checksum (\S+)$", out, re.M)
    assert found, f"no final checksum in:\n{out[-3000:]}"
    return float(found[-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """What a user has: checkpoint directories (save_pretrained) with a tokenizer trained on the text."""
    from fxshard.testing.hf_checkpoints import make_hf_checkpoint

    root = tmp_path_factory.mktemp("hf")
    return {"llama": make_hf_checkpoint(root / "llama", "llama", text_files=[TEXT], num_hidden_layers=4),
            "qwen3": make_hf_checkpoint(root / "qwen3", "qwen3", text_files=[TEXT]),
            "qwen3_moe": make_hf_checkpoint(root / "qwen3_moe", "qwen3_moe", text_files=[TEXT]),
            "mixtral": make_hf_checkpoint(root / "mixtral", "mixtral", text_files=[TEXT])}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


def _common(model, cache) -> list[str]:
    return ["--model", str(model), "--data", TEXT, "--eval-split", HELD_OUT, "--eval-every", "3", "--eval-batches", "2",
            "--steps", str(STEPS), "--batch", "8", "--seq", "32", "--clip", "0.5", "--accum", "2", "--seed", "3",
            "--data-cache", cache]


@pytest.fixture(scope="module")
def one_process(checkpoints, cache, tmp_path_factory):
    """One process per model: the losses, eval losses, checksum and export every mesh is held to."""
    out = {}
    for name, ckpt in checkpoints.items():
        if name == "qwen3":  # only in the bf16 test
            continue
        logs, export = tmp_path_factory.mktemp(f"one_{name}"), tmp_path_factory.mktemp(f"export_{name}")
        stdout = _run(1, _common(ckpt, cache) + ["--log-dir", str(logs), "--export-hf", str(export)])
        out[name] = (*_records(logs), _checksum(stdout), str(export))
    return out


MESHES = [("llama", "dp=2,tp=2", 4, ["--compile", "aot_eager"]), ("llama", "pp=2,tp=2", 4, []),
          ("llama", "pp=2,dp=2", 4, ["--activation-checkpointing"]), ("llama", "cp=2,tp=2", 4, []),
          ("qwen3_moe", "ep=2", 2, []), ("qwen3_moe", "dp=2,ep=2", 4, []),
          # the routed experts as fxshard's grouped GEMMs (one process: HF's own grouped_mm kernel)
          ("mixtral", "ep=2", 2, []), ("mixtral", "dp=2,ep=2", 4, []),
          # FSDP2 reduce-scattering every accumulation pass, its gradients accumulated sharded (torchtitan's)
          ("mixtral", "dp=2,ep=2", 4, ["--accum-grads", "sharded"]),
          ("llama", "pp=2", 2, ["--schedule", "Interleaved1F1B", "--microbatches", "2"]),
          # torchtitan's per-op selective checkpointing on the program's blocks, under FSDP2 x tp and pp x FSDP2
          ("llama", "dp=2,tp=2", 4, ["--activation-checkpointing", "selective"]),
          ("llama", "pp=2,dp=2", 4, ["--activation-checkpointing", "selective"]),
          ("llama", "auto", 2, ["--memory-gib", "4"]),
          # tp is sequence- and loss-parallel: the MoE blocks take gathered sequences, the loss vocab shards
          ("qwen3_moe", "ep=2,tp=2", 4, [])]


# the widest cases run in .ci/run's second stage (pytest -m sweep), keeping the main stage under 30 minutes
SWEEP_MESHES = {"pp=2,dp=2 --activation-checkpointing selective",
                # --compile is proven in the main stage by tests/test_compile.py and test_regional_compile.py
                "dp=2,tp=2 --compile aot_eager",
                # the library's no_sync(sharded_grads=True) is proven in the main stage (tests/test_accumulate.py)
                "dp=2,ep=2 --accum-grads sharded"}


@pytest.mark.parametrize("model,mesh,nproc,extra", [
    pytest.param(*case, id=" ".join([case[1], *case[3]]),
                 marks=[pytest.mark.sweep] if " ".join([case[1], *case[3]]) in SWEEP_MESHES else [])
    for case in MESHES])
def test_mesh_trains_as_one_process(model, mesh, nproc, extra, checkpoints, cache, one_process, tmp_path):
    """The losses of one process at every step, the eval losses, the checksum and the export's logits."""
    want, want_eval, want_checksum, want_export = one_process[model]
    export = tmp_path / "export"
    stdout = _run(nproc, _common(checkpoints[model], cache) + ["--mesh", mesh, "--log-dir", str(tmp_path),
                                                               "--export-hf", str(export), *extra])
    got, got_eval = _records(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    for step, rec in want.items():
        assert abs(got[step]["loss"] - rec["loss"]) <= 1e-5, (mesh, step, got[step]["loss"], rec["loss"])
        assert abs(got[step]["grad_norm"] - rec["grad_norm"]) <= 1e-4 * rec["grad_norm"], (mesh, step)
        assert got[step]["tokens_per_s"] > 0 and got[step]["peak_mem_gib"] > 0
    assert want[STEPS]["loss"] < want[1]["loss"] - 0.05, "the run does not learn the text: the comparison proves little"
    assert sorted(got_eval) == [3, 6] and all(abs(got_eval[s] - want_eval[s]) <= 1e-5 for s in want_eval), (got_eval, want_eval)
    assert abs(_checksum(stdout) - want_checksum) <= 1e-6 * abs(want_checksum) + 1e-4
    # the export: transformers loads it, with the trained program's logits (its loss under pp)
    check = re.search(r"from_pretrained\(.*\) vs the (logits|loss) of the trained program, (?:max )?difference (\S+)", stdout)
    assert check and float(check.group(2)) <= 1e-5, stdout[-2000:]
    pipelined = re.search(r"^fxshard train: .* on .*pp=", stdout, re.M) is not None
    assert check.group(1) == ("loss" if pipelined else "logits")
    _same_logits(str(export), want_export)
    accumulation = re.search(r"^accumulation: 2 passes a step; FSDP2's gradients (.*)$", stdout, re.M)
    fsdp_accumulates = any(a in mesh for a in ("dp=", "cp=")) and "pp=" not in mesh  # under pp the schedule's
    assert mesh == "auto" or (accumulation is not None) == fsdp_accumulates, stdout[:3000]
    if accumulation:
        assert ("reduce-scattered every pass" in accumulation.group(1)) == ("--accum-grads" in extra), accumulation.group(1)
    if mesh == "auto":  # the planner's choice, said before the run
        assert re.search(r"^mesh auto: --mesh \S+", stdout, re.M), stdout[:2000]
    holds = re.search(r"^holds: (.*)$", stdout, re.M).group(1)
    if mesh == "pp=2,tp=2":  # each pipeline rank holds its half of the blocks
        assert "blocks 0-1" in holds and "blocks 2-3" in holds and "blocks 0-3" not in holds, holds
    if "Interleaved1F1B" in extra:  # 4 stages over 2 ranks: rank 0 stages 0 and 2
        assert "rank 0 blocks 0,2" in holds and "rank 1 blocks 1,3" in holds, holds


def _same_logits(a: str, b: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    ids = torch.tensor([tok("In the beginning God created the heaven and the earth.")["input_ids"]])
    with torch.no_grad():
        la = AutoModelForCausalLM.from_pretrained(a).eval()(input_ids=ids).logits
        lb = AutoModelForCausalLM.from_pretrained(b).eval()(input_ids=ids).logits
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model", ["llama", "qwen3", pytest.param("qwen3 type", marks=pytest.mark.sweep)])
def test_bf16_fsdp_param_dtype(model, checkpoints, cache, tmp_path):
    """--bf16 at dp=2,tp=2 is FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on the
    HF program, with --accum 2 (fxshard.no_sync: Qwen3's q/k norms have tensor-parallel syncs held
    back while FSDP2 accumulates in fp32); within bf16 tolerance of one process under bf16 autocast.
    ``qwen3 type``: HF's Qwen3 built from its type (random weights, a real model transformed)."""
    source = ["--model", "qwen3", "--model-config", "num_hidden_layers=2"] if model == "qwen3 type" else []
    args = _common(checkpoints[model.split()[0]], cache) + source + ["--bf16", "--eval-every", "0", "--steps", "4"]
    _run(1, args + ["--log-dir", str(tmp_path / "one")])
    out = _run(4, args + ["--mesh", "dp=2,tp=2", "--log-dir", str(tmp_path / "mesh")])
    assert "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)" in out
    want, _ = _records(tmp_path / "one")
    got, _ = _records(tmp_path / "mesh")
    for step, rec in want.items():
        assert abs(got[step]["loss"] - rec["loss"]) <= 3e-2 * rec["loss"], (model, step, got[step]["loss"], rec["loss"])


@pytest.mark.sweep  # the longest trainer run (a kill, a restart, a resume): the second stage
def test_killed_rank_resumes_with_its_data_position(checkpoints, cache, tmp_path):
    """A rank SIGKILLed at a random step; ``torchrun --max-restarts=1`` restarts the run, which
    resumes from the last committed checkpoint (weights, optimizer, scheduler, data position)
    and ends at the uninterrupted run's checksum, bit for bit."""
    steps = 8
    args = _common(checkpoints["llama"], cache) + ["--steps", str(steps), "--mesh", "dp=2,tp=2", "--ckpt-every", "2"]
    want = _checksum(_run(4, args + ["--ckpt-dir", str(tmp_path / "uninterrupted")]))
    kill_after = random.Random(time.time_ns()).randint(3, steps - 2)
    cmd = _cmd(4, args + ["--ckpt-dir", str(tmp_path / "killed")], restarts=1)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT)
    lines, killed = [], None
    try:
        deadline = time.monotonic() + TIMEOUT
        for line in proc.stdout:
            lines.append(line)
            if killed is None and line.startswith(f"step {kill_after} loss"):
                workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                           if "fxshard" in " ".join(p.cmdline()) and "torch.distributed.run" not in " ".join(p.cmdline())]
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
    assert _checksum(out) == want, f"killed after step {kill_after}: {_checksum(out)!r} != {want!r}"


@pytest.mark.parametrize("case", ["bad mesh, before the processes meet", "missing data, after they meet"])
def test_an_error_under_torchrun_is_printed_once(case, tmp_path):
    """Every rank hits the error; one prints it (rank 0 before the process group exists, else the
    first rank that failed), the others exit silently; the run's exit status is non-zero. What
    follows is torchrun's own summary of the failed workers."""
    args = ["--model", "llama", "--data", TEXT, "--steps", "1", "--batch", "4", "--seq", "32",
            "--data-cache", str(tmp_path / "tokens"), "--mesh", "dp=4"]
    if case.startswith("bad mesh"):
        args[args.index("dp=4")], want = "dp=2,foo=2", "unknown axis 'foo'"
    else:
        args[args.index(TEXT)], want = str(tmp_path / "missing.txt"), f"fxshard train: error: data file {tmp_path / 'missing.txt'}"
    done = subprocess.run(_cmd(4, args), capture_output=True, text=True, timeout=TIMEOUT, env=_env(), cwd=ROOT)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-3000:]
    assert out.count("fxshard train: error:") == 1 and want in out, out[-5000:]
    assert out.count("  fix: ") == 1, out[-5000:]
    worker_tracebacks = [m for m in re.finditer(r"Traceback \(most recent call last\):\n(.*\n){0,4}", out)
                         if "torch/distributed/run.py" not in m.group(0) and "runpy" not in m.group(0)]
    assert not worker_tracebacks, out[-5000:]


FSDP_MESHES = [("cp=2,dp=2", 4, True), ("cp=2", 2, False),
               pytest.param("dp_replicate=2,dp=2", 4, True, marks=pytest.mark.sweep, id="dp_replicate=2,dp=2")]


@pytest.mark.parametrize("mesh,nproc,resume", FSDP_MESHES, ids=["cp=2,dp=2", "cp=2", "dp_replicate=2,dp=2"])
def test_fsdp_over_dp_cp_and_hsdp(mesh, nproc, resume, checkpoints, cache, one_process, tmp_path):
    """FSDP2 shards every parameter over dp x cp (torchtitan's ``dp_shard_cp``; over cp alone at
    dp=1), HSDP replicates over ``dp_replicate`` and shards within: each rank holds its share of
    every parameter, and every step's loss and grad norm are one process's (1e-5), also across
    a save and a resume (the last checkpoint removed, the same command resumes from the one before)."""
    want, _, want_checksum, _ = one_process["llama"]
    ckpt = tmp_path / "ckpt"
    args = _common(checkpoints["llama"], cache) + ["--mesh", mesh, "--log-dir", str(tmp_path), "--ckpt-dir", str(ckpt),
                                                    "--ckpt-every", "3", "--eval-every", "0"]
    stdout = _run(nproc, args)
    ranks = [int(p.replace(",", "")) for p in re.findall(r"rank \d+ blocks \S+ params ([\d,]+)", stdout)]
    total = int(re.search(r"^holds: .*\(of ([\d,]+)\)$", stdout, re.M).group(1).replace(",", ""))
    replicas = 2 if "dp_replicate" in mesh else 1
    shards = nproc // replicas
    # every parameter cut in pieces: no rank holds more than its 1/shards (FSDP2 pads dim 0 to a multiple), and
    # the pieces add up to the model once per replica: a parameter replicated over cp would add up to more
    assert len(ranks) == nproc and sum(ranks) == total * replicas, (ranks, total)
    assert max(ranks) <= total / shards * 1.01, (ranks, total, shards)
    steps = {STEPS}
    if resume:
        import shutil

        last = ckpt / f"step{STEPS:06d}"
        assert last.is_dir() and (ckpt / f"step{3:06d}").is_dir(), sorted(os.listdir(ckpt))
        shutil.rmtree(last)
        stdout = _run(nproc, args)
        assert re.search(r"^resumed from \S+ at step 3$", stdout, re.M), stdout[-3000:]
    got, _ = _records(tmp_path)
    assert sorted(got) == list(range(1, STEPS + 1)), sorted(got)
    for step, rec in want.items():
        assert abs(got[step]["loss"] - rec["loss"]) <= 1e-5, (mesh, step, got[step]["loss"], rec["loss"])
        assert abs(got[step]["grad_norm"] - rec["grad_norm"]) <= 1e-5 * rec["grad_norm"], (mesh, step)
    assert abs(_checksum(stdout) - want_checksum) <= 1e-6 * abs(want_checksum) + 1e-4
