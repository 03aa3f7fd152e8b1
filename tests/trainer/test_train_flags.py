"""Every flag of ``python -m fxshard train`` does what ``--help`` says, and what the trainer
cannot run is refused before any work (exit status 2, a message naming the fix).

One process, in this process (``fxshard.__main__.main``): the runs are a few steps of a
small random-weight Llama on the shipped text; the meshes are in ``test_train_cli.py``.
"""
from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("transformers")

from fxshard.__main__ import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXT = os.path.join(ROOT, "examples", "data", "genesis.txt")
HELD_OUT = os.path.join(ROOT, "examples", "data", "genesis.eval.txt")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tokens"))


def train(tmp_path, cache, *extra, steps=3):
    """Run the trainer; returns the train records and eval records of metrics.jsonl, by step."""
    logs = tmp_path / f"logs{len(os.listdir(tmp_path))}"
    argv = ["train", "--model", "llama", "--data", TEXT, "--steps", str(steps), "--batch", "4", "--seq", "32",
            "--data-cache", cache, "--log-dir", str(logs), *extra]
    assert main(argv) == 0
    train_recs, eval_recs = {}, {}
    with open(logs / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            (eval_recs if "eval_loss" in rec else train_recs)[rec["step"]] = rec
    return train_recs, eval_recs


def refused(capsys, *argv) -> str:
    assert main(["train", *argv]) == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- refusals, before any work


@pytest.mark.parametrize("argv,says", [
    (["--mesh", "foo=2"], "unknown axis 'foo'"),
    (["--mesh", "tp=2"], "has 2 ranks, but 1 processes run"),
    (["--mesh", "tp"], "is not AXIS=SIZE"),
    (["--mesh", "tp=2,tp=2"], "given twice"),
    (["--mesh", "dp_replicate=2,cp=2"], "dp_replicate=2 (HSDP) replicates the parameters"),
    (["--model", "foo"], "torchtitan-llama3"),
    (["--model", "./no/such/dir"], "no such directory"),
    (["--microbatches", "2"], "without a pp axis"),
    (["--schedule", "GPipe"], "without a pp axis"),
    (["--ckpt-every", "2"], "--ckpt-dir"),
    (["--eval-every", "2"], "--eval-split"),
    (["--autocast"], "--bf16 --autocast"),
    (["--batch", "6", "--accum", "4"], "--batch 6, --accum 4 on one process: accum=4 passes do not divide each dp "
                                       "rank's 6 rows\n  fix: --batch a multiple of 4"),
    (["--accum-grads", "sharded"], "--accum 1 has no passes to accumulate over"),
    (["--accum", "2", "--accum-grads", "unsharded"], "one process has no FSDP2 (dp or cp), so it would change nothing"),
    (["--seq", "1"], "--seq 1: at least 2"),
    (["--model-config", "no_such_field=1"], "no_such_field"),
    (["--model", "torchtitan-llama3", "--export-hf", "out"], "an HF checkpoint needs an HF model"),
    (["--memory-gib", "8"], "--memory-gib without --mesh auto"),
])
def test_refused_with_the_fix(capsys, argv, says):
    err = refused(capsys, "--data", TEXT, *argv)
    assert says in err, err


def test_unknown_axis_lists_the_axes(capsys):
    err = refused(capsys, "--data", "no-such-file.txt", "--mesh", "foo=2")  # the mesh is read before the data
    assert all(f"{a} (" in err for a in ("dp", "tp", "pp", "cp", "ep")), err


def test_model_list_names_the_kinds(capsys):
    err = refused(capsys, "--data", TEXT, "--model", "foo")
    assert "checkpoint directory" in err and "qwen3" in err and "llama" in err, err


def test_missing_data_file(capsys, tmp_path):
    err = refused(capsys, "--data", str(tmp_path / "missing.txt"), "--data-cache", str(tmp_path))
    assert "missing.txt" in err, err


def test_checkpoint_directory_takes_no_model_config(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    err = refused(capsys, "--data", TEXT, "--model", str(tmp_path), "--model-config", "hidden_size=32")
    assert "config.json is the model" in err, err


def test_help_lists_every_axis_and_model_kind(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for word in ("dp:", "tp:", "pp:", "cp:", "ep:", "torchtitan-llama3", "save_pretrained", "--export-hf", "--bf16"):
        assert word in out, word


# ----------------------------------------------------------------------------- flags that change the run


def test_records_and_eval(tmp_path, cache):
    recs, evals = train(tmp_path, cache, "--eval-split", HELD_OUT, "--eval-every", "2", "--eval-batches", "1",
                        "--peak-tflops", "2.0", steps=4)
    assert sorted(recs) == [1, 2, 3, 4] and sorted(evals) == [2, 4]
    for rec in recs.values():
        assert {"loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "peak_mem_gib"} <= set(rec)
        assert rec["tokens_per_s"] > 0 and rec["peak_mem_gib"] > 0
        assert math.isclose(rec["mfu"], rec["tflops"] / 2.0, rel_tol=1e-9)
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "logs0")), "no TensorBoard events"


def test_log_every(tmp_path, cache):
    recs, _ = train(tmp_path, cache, "--log-every", "2", steps=5)
    assert sorted(recs) == [2, 4, 5]


def test_lr_warmup_then_cosine(tmp_path, cache):
    recs, _ = train(tmp_path, cache, "--lr", "0.01", "--warmup", "2", steps=4)
    lrs = [recs[s]["lr"] for s in (1, 2, 3, 4)]
    want = [0.005, 0.01, 0.01, 0.01 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))]
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(lrs, want)), lrs


def test_accumulation_is_the_same_step(tmp_path, cache):
    one, _ = train(tmp_path, cache)
    two, _ = train(tmp_path, cache, "--accum", "2")
    for s in one:
        assert abs(one[s]["loss"] - two[s]["loss"]) <= 1e-5 and abs(one[s]["grad_norm"] - two[s]["grad_norm"]) <= 1e-4


def test_clip_seed_and_weight_decay_change_the_run(tmp_path, cache):
    base, _ = train(tmp_path, cache, "--clip", "0")
    clipped, _ = train(tmp_path, cache, "--clip", "0.01")
    assert clipped[1]["grad_norm"] == pytest.approx(base[1]["grad_norm"]) and clipped[1]["grad_norm"] > 0.01
    assert abs(clipped[3]["loss"] - base[3]["loss"]) > 1e-3, "clipping to 0.01 changed nothing"
    reseeded, _ = train(tmp_path, cache, "--clip", "0", "--seed", "1")
    assert abs(reseeded[1]["loss"] - base[1]["loss"]) > 1e-4, "--seed changed neither weights nor data order"
    decayed, _ = train(tmp_path, cache, "--clip", "0", "--weight-decay", "0.0", "--lr", "0.05")
    plain, _ = train(tmp_path, cache, "--clip", "0", "--lr", "0.05")
    assert decayed[3]["loss"] != plain[3]["loss"]


def test_activation_checkpointing_same_numbers(tmp_path, cache):
    plain, _ = train(tmp_path, cache)
    ac, _ = train(tmp_path, cache, "--activation-checkpointing")
    assert all(abs(plain[s]["loss"] - ac[s]["loss"]) <= 1e-5 for s in plain)


def test_bf16_within_bf16_tolerance(tmp_path, cache):
    plain, _ = train(tmp_path, cache)
    bf16, _ = train(tmp_path, cache, "--bf16")
    assert all(abs(plain[s]["loss"] - bf16[s]["loss"]) <= 3e-2 * plain[s]["loss"] for s in plain)
    assert any(plain[s]["loss"] != bf16[s]["loss"] for s in plain), "--bf16 changed nothing"


def test_jsonl_and_parquet_text_field(tmp_path, cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    text = open(TEXT).read()
    docs = [d for d in text.split("\n\n") if d.strip()][:400]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": docs}), parquet)
    a, _ = train(tmp_path, cache, "--data", str(jsonl), "--text-field", "body")
    b, _ = train(tmp_path, cache, "--data", str(parquet), "--text-field", "body")
    assert a[1]["loss"] == b[1]["loss"], "the same documents as jsonl and as parquet give other batches"


def test_checkpoints_keep_last_and_resume(tmp_path, cache):
    ckpt = tmp_path / "ckpt"
    full, _ = train(tmp_path, cache, "--ckpt-dir", str(ckpt), "--ckpt-every", "1", "--keep-last", "2", steps=4)
    assert sorted(d for d in os.listdir(ckpt) if d.startswith("step")) == ["step000003", "step000004"]
    assert os.path.isfile(ckpt / "hf_model" / "config.json") and os.path.isfile(ckpt / "hf_model" / "tokenizer.json")
    # a run to 6 steps resumes at 4: its steps 5-6 read what an uninterrupted 6-step run reads
    import shutil

    shutil.rmtree(ckpt / "step000004")
    resumed, _ = train(tmp_path, cache, "--ckpt-dir", str(ckpt), "--ckpt-every", "1", steps=4)
    assert sorted(resumed) == [4], "a resumed run starts after its checkpoint"
    assert abs(resumed[4]["loss"] - full[4]["loss"]) <= 1e-6


def test_no_checkpoint_digests(tmp_path, cache):
    """--no-checkpoint-digests: the commit file lists sizes without digests, and a resume checks
    sizes only; without it every file has its SHA-256, checked at resume."""
    from fxshard.state.checkpoint import COMMIT_FILE

    def listed(ckpt):
        with open(ckpt / "step000002" / COMMIT_FILE) as f:
            return json.load(f)["files"]

    with_digests, without = tmp_path / "with", tmp_path / "without"
    train(tmp_path, cache, "--ckpt-dir", str(with_digests), "--ckpt-every", "2", steps=2)
    train(tmp_path, cache, "--ckpt-dir", str(without), "--ckpt-every", "2", "--no-checkpoint-digests", steps=2)
    assert listed(with_digests) and all(len(v["sha256"]) == 64 for v in listed(with_digests).values())
    assert listed(without) and all(v["sha256"] is None and v["size"] > 0 for v in listed(without).values())
    # a flipped byte: refused at resume with the digests, unseen without them (sizes equal)
    for ckpt in (with_digests, without):
        shard = sorted((ckpt / "step000002").glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    assert main(["train", "--model", "llama", "--data", TEXT, "--steps", "3", "--batch", "4", "--seq", "32",
                 "--data-cache", cache, "--ckpt-dir", str(with_digests)]) == 2
    resumed, _ = train(tmp_path, cache, "--ckpt-dir", str(without), "--no-checkpoint-digests", steps=3)
    assert sorted(resumed) == [3]


def test_export_command(tmp_path, cache, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt"
    train(tmp_path, cache, "--ckpt-dir", str(ckpt), "--ckpt-every", "3", steps=3)
    assert main(["export", str(ckpt / "step000003"), str(tmp_path / "out")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    state = torch.load(ckpt / "step000003" / "state.0.pt", weights_only=True)
    assert state["step"] == 3 and isinstance(state["data"]["position"], int)
    assert model.config.vocab_size >= 257


@pytest.mark.isolated  # the planner runs torch's fake process group, process-wide
def test_mesh_auto_one_process(tmp_path, cache, capsys):
    recs, _ = train(tmp_path, cache, "--mesh", "auto", "--memory-gib", "4")
    assert sorted(recs) == [1, 2, 3]
    assert "mesh auto: one process" in capsys.readouterr().out
