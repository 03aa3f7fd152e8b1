"""FSDP2 on stacked experts with fewer experts per rank than FSDP ranks (issue 42, item 6).

Under ep a rank keeps ``E/ep`` experts, stacked ``[E/ep, 2I, H]`` / ``[E/ep, H, I]``; over more
FSDP ranks than that, dim 0 would leave each expert whole on one rank (Mixtral-8x7B at dp=8,
ep=8: 1 expert per ep rank).  ``fxshard.fully_shard`` cuts each parameter on
``fsdp_shard_dim``'s dim (dim 1 there, as torchtitan's ``Shard(1)``):

* the rule on the shapes torchtitan's ``apply_fsdp`` decides, and the elements a rank keeps;
* ``python -m fxshard train`` on 4 gloo ranks, a Mixtral checkpoint with 2 experts at
  ``dp=2,ep=2`` (1 expert per ep rank over dp=2): every rank holds the dense half and a quarter
  of the experts (counted from the config here), every step's loss, grad norm and eval loss,
  the checksum and the export's logits are one process's; the step-6 checkpoint read into a
  plain model (one device) holds one process's weights and AdamW state; with the last
  checkpoint removed, the same command resumes at step 3 to the same losses.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from fxshard.training.fsdp import fsdp_shard_dim, fsdp_shard_numel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = os.path.join(ROOT, "examples", "data", "genesis.txt")
HELD_OUT = os.path.join(ROOT, "examples", "data", "genesis.eval.txt")
STEPS = 6


@pytest.mark.parametrize("shape, ranks, dim", [
    ((1, 28672, 4096), 8, 1),    # Mixtral-8x7B gate_up at ep=8 over dp=8: torchtitan's Shard(1)
    ((1, 4096, 14336), 8, 1),    # its down projection
    ((8, 28672, 4096), 64, 1),   # ep=1 over 64 FSDP ranks (torchtitan: efsdp 64 > 8 experts)
    ((16, 1536, 2048), 8, 0),    # Qwen3-30B-A3B at ep=8: 16 experts per rank over dp=8
    ((32000, 4096), 8, 0),       # a dense weight that dp divides
    ((3, 64, 16), 2, 1),         # dim 0 not divided: the first dim that is (no padding)
    ((7, 5), 2, 0),              # nothing divided: dim 0, padded (FSDP2 cuts no other dim unevenly)
    ((5,), 1, 0),                # one rank
])
def test_shard_dim(shape, ranks, dim):
    assert fsdp_shard_dim(shape, ranks) == dim


def test_shard_numel():
    """Elements one rank stores: an even cut's 1/ranks; dim 0's padded piece when nothing divides."""
    assert fsdp_shard_numel((1, 28672, 4096), 8) * 8 == 28672 * 4096
    assert fsdp_shard_numel((3, 64, 16), 2) == 3 * 32 * 16
    assert fsdp_shard_numel((7, 5), 2) == 4 * 5  # torch.chunk: pieces of 4 and 3 rows, both stored at 4
    assert fsdp_shard_numel((), 4) == 1 and fsdp_shard_numel((0, 8), 2) == 0


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _train(nproc: int, args: list[str]) -> str:
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"])
    done = subprocess.run([*launcher, "-m", "fxshard", "train", *args], capture_output=True, text=True, timeout=600,
                          env=_env(), cwd=ROOT)
    assert done.returncode == 0, f"{' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _records(log_dir) -> dict[int, dict]:
    out = {}
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            out.setdefault(rec["step"], {}).update(rec)
    return out


def _checksum(stdout: str) -> float:
    return float(re.findall(r"^final checksum (\S+)$", stdout, re.M)[-1])


def _read_checkpoint(path: str, config_dir: str):
    """A fxshard checkpoint read into a plain single-device model and AdamW (no process group)."""
    import fxshard
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    opt = torch.optim.AdamW(model.parameters())
    fxshard.load(model, path, optimizer=opt, show_progress=False)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"{names[id(p)]}.{k}": v for p, s in opt.state.items() for k, v in s.items() if torch.is_tensor(v) and v.dim()}
    return {n: t.detach() for n, t in model.state_dict().items()}, state


@pytest.mark.sweep  # a 4-rank torchrun run (~100 s): .ci/run's second stage
def test_one_expert_per_rank_over_dp2_trains_as_one_process(tmp_path):
    pytest.importorskip("transformers")
    from fxshard.testing.hf_checkpoints import make_hf_checkpoint

    ckpt = make_hf_checkpoint(tmp_path / "mixtral", "mixtral", text_files=[TEXT], num_local_experts=2)
    common = ["--model", str(ckpt), "--data", TEXT, "--eval-split", HELD_OUT, "--eval-every", "3", "--eval-batches", "2",
              "--steps", str(STEPS), "--batch", "8", "--seq", "32", "--clip", "0.5", "--accum", "2", "--seed", "3",
              "--data-cache", str(tmp_path / "tokens"), "--ckpt-every", "3"]
    one = _train(1, common + ["--log-dir", str(tmp_path / "one"), "--ckpt-dir", str(tmp_path / "one_ckpt"),
                              "--export-hf", str(tmp_path / "one_export")])
    sharded_args = common + ["--mesh", "dp=2,ep=2", "--log-dir", str(tmp_path / "dpep"),
                             "--ckpt-dir", str(tmp_path / "dpep_ckpt")]
    got = _train(4, sharded_args + ["--export-hf", str(tmp_path / "dpep_export")])

    # what each rank holds: half of every dense parameter (FSDP2 over dp; replicated over ep) and a
    # quarter of the experts (ep=2 owns half of them, FSDP2 halves each along its dim 1): counted here
    config = json.loads((ckpt / "config.json").read_text())
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    assert expert == config["num_hidden_layers"] * 2 * 3 * config["hidden_size"] * config["intermediate_size"]
    held = [int(p.replace(",", "")) for p in re.findall(r"rank \d+ blocks \S+ params ([\d,]+)", got)]
    assert held == [dense // 2 + expert // 4] * 4, (held, dense, expert)  # dim 0: one rank would hold expert // 2

    want, mine = _records(tmp_path / "one"), _records(tmp_path / "dpep")
    assert sorted(mine) == list(range(1, STEPS + 1))
    for step, rec in want.items():
        assert abs(mine[step]["loss"] - rec["loss"]) <= 1e-5, (step, mine[step], rec)
        assert abs(mine[step]["grad_norm"] - rec["grad_norm"]) <= 1e-5 * rec["grad_norm"], (step, mine[step], rec)
        if "eval_loss" in rec:
            assert abs(mine[step]["eval_loss"] - rec["eval_loss"]) <= 1e-5, (step, mine[step], rec)
    assert want[STEPS]["loss"] < want[1]["loss"] - 0.05, "the run does not learn the text: the comparison proves little"
    assert abs(_checksum(got) - _checksum(one)) <= 1e-6 * abs(_checksum(one)) + 1e-4
    check = re.search(r"vs the logits of the trained program, (?:max )?difference (\S+)", got)
    assert check and float(check.group(1)) <= 1e-5, got[-2000:]

    # the checkpoint the 4 ranks wrote (each its FSDP2 piece of its experts) read on one device:
    # one process's weights and AdamW state
    last = f"step{STEPS:06d}"
    weights, state = _read_checkpoint(str(tmp_path / "dpep_ckpt" / last), str(ckpt))
    want_weights, want_state = _read_checkpoint(str(tmp_path / "one_ckpt" / last), str(ckpt))
    assert any(".experts." in k for k in state) and set(state) == set(want_state)
    for name, t in {**weights, **state}.items():
        ref = {**want_weights, **want_state}[name]
        # Adam's steps amplify the sum order's rounding where a gradient is near 0: 1e-4 of the tensor's scale
        torch.testing.assert_close(t, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()), msg=lambda m: f"{name}: {m}")

    # resumed from step 3's checkpoint (the last one removed): the same steps again
    shutil.rmtree(tmp_path / "dpep_ckpt" / last)
    again = _train(4, sharded_args)
    assert re.search(r"^resumed from \S+ at step 3$", again, re.M), again[-3000:]
    mine = _records(tmp_path / "dpep")
    for step in range(4, STEPS + 1):
        assert abs(mine[step]["loss"] - want[step]["loss"]) <= 1e-5, (step, mine[step], want[step])
    assert abs(_checksum(again) - _checksum(one)) <= 1e-6 * abs(_checksum(one)) + 1e-4
