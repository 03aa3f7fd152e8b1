"""The planner in one process: its shortcuts give the numbers the long way gives, its rules
say why, its refusals name the fix (real ranks: ``test_planner_accuracy.py``)."""
from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)
import torch

pytest.importorskip("transformers")

import fxshard  # noqa: E402
from fxshard.planner import Calibration, best_mesh, calibrate, format_table, plan_parallelism  # noqa: E402
from fxshard.planner.facts import Captures, SubPlan, program_facts  # noqa: E402
from fxshard.planner.model import PlannedModel  # noqa: E402
from fxshard.trainer.models import ModelSource  # noqa: E402

SEQ = 16


def _llama(layers: int = 2):
    source = ModelSource.resolve("llama", {"num_hidden_layers": layers})
    source.positions = SEQ
    return source.build(meta=False)


def _same_facts(a, b, unit_a: str, unit_b: str) -> None:
    x, y = a.units[unit_a], b.units[unit_b]
    rel = lambda fqn: fqn.split(unit_a + ".", 1)[-1].split(unit_b + ".", 1)[-1]  # noqa: E731
    assert [(rel(f), s, z) for f, s, z in x.params] == [(rel(f), s, z) for f, s, z in y.params], unit_a
    for field in ("saved", "shared", "matmul_flops", "other_bytes", "kernels"):
        assert getattr(x, field) == getattr(y, field), (unit_a, field, getattr(x, field), getattr(y, field))
    assert x.comm == y.comm and x.inputs == y.inputs, unit_a


def test_one_captured_block_stands_for_every_block_of_its_kind():
    model = _llama(layers=5)  # a stack of 5 alike blocks: captured as one
    planned = PlannedModel.resolve(model)
    assert planned.prefix == 1 and len(planned.block_names()) == 5
    whole = PlannedModel.resolve(model)
    whole.stamp = None  # every block captured
    short = program_facts(Captures(planned, SEQ), SubPlan(tp=2))
    full = program_facts(Captures(whole, SEQ), SubPlan(tp=2))
    assert short.captured == ["model.layers.0"] and len(full.captured) == 5 and short.n_blocks == full.n_blocks == 5
    for unit in ("<before>", "<after>"):
        _same_facts(short, full, unit, unit)
    for i in range(1, 5):  # block 0 may differ (it reads the embedding), the others are alike
        _same_facts(short, full, "model.layers.0", f"model.layers.{i}")


def test_one_capture_serves_every_tensor_parallel_degree():
    planned = PlannedModel.resolve(_llama())
    shared = Captures(planned, SEQ)
    program_facts(shared, SubPlan(tp=2))
    one = program_facts(shared, SubPlan(tp=1))  # from the capture made for tp=2's plan
    assert len(shared.graphs) == 1
    alone = program_facts(Captures(planned, SEQ), SubPlan(tp=1))
    for unit in one.units:
        _same_facts(one, alone, unit, unit)


def test_rules_rejections_and_ranking():
    model = _llama()
    entries = plan_parallelism(model, 4, memory_gib=1, seq=SEQ, global_batch=8, device="cpu", candidates=[
        {"tp": 2}, {"dp": 3}, {"pp": 4}, {"ep": 2}, {"pp": 2, "microbatches": 1}, {"pp": 2, "microbatches": 3}])
    reasons = {(e.mesh_spec, e.microbatches): e.reason for e in entries}
    assert reasons[("dp=2,tp=2", 1)] is None
    assert reasons[("dp=3", 1)] == "the mesh has 3 ranks, not 4"
    assert "more than the 2 blocks" in reasons[("pp=4", 8)]
    assert reasons[("dp=2,ep=2", 1)] == "ep=2: the model has no routed experts"
    assert "at least as many micro-batches as pp=2" in reasons[("pp=2,dp=2", 1)]
    assert "3 micro-batches do not divide each dp rank's 4 rows" in reasons[("pp=2,dp=2", 3)]
    assert entries[0].fits and not any(e.fits for e in entries[1:])
    text = format_table(entries)
    assert "dp=2,tp=2" in text.splitlines()[1] and "rejected: the mesh has 3 ranks" in text
    odd = {e.mesh_spec: e.reason for e in plan_parallelism(model, 3, memory_gib=1, seq=SEQ, global_batch=3, device="cpu",
                                                          candidates=[{"tp": 3}, {"cp": 3}])}
    assert odd == {"tp=3": "tp=3 does not divide the 4 attention heads",
                   "cp=3": "cp=3 does not divide the sequence of 16 tokens into 6 pieces"}


def test_memory_and_what_fits():
    model = _llama()
    entries = plan_parallelism(model, 4, memory_gib=1e-4, seq=SEQ, global_batch=8, device="cpu")
    assert entries and not any(e.fits for e in entries)
    assert entries[0].reason.startswith("memory: ") and "GiB on a rank > 0.0001 GiB" in entries[0].reason
    with pytest.raises(fxshard.PlanError, match="no mesh of 4 ranks fits.*\n  fix: more ranks or memory"):
        best_mesh(model, 4, 1e-4, seq=SEQ, global_batch=8, device="cpu")
    best = plan_parallelism(model, 4, memory_gib=1, seq=SEQ, global_batch=8, device="cpu")
    fits = [e for e in best if e.fits]
    assert fits and [e.step_time_s for e in fits] == sorted(e.step_time_s for e in fits)
    e = fits[0]
    assert set(e.memory) == {"params", "grads", "optimizer", "activations", "transient", "loss", "total"}
    assert e.memory["grads"] == e.memory["params"] and e.memory["optimizer"] == 2 * e.memory["params"]
    assert e.memory["total"] == pytest.approx(sum(v for k, v in e.memory.items() if k != "total"))
    assert best_mesh(model, 4, 1, seq=SEQ, global_batch=8, device="cpu") == e.mesh_spec
    assert e.trainer_flags().startswith(f"--mesh {e.mesh_spec}")


def test_refusals_name_the_fix():
    model = _llama()
    with pytest.raises(fxshard.PlanError, match="fix: seq=..., global_batch="):
        plan_parallelism(model, 2, memory_gib=1)
    assert plan_parallelism(model, 2, memory_gib=1, example_kwargs={"input_ids": torch.zeros(4, SEQ, dtype=torch.long)},
                            device="cpu", candidates=[{"tp": 2}])[0].fits
    # no memory given: a CPU's is this machine's over its ranks (test_plan_cli.py)
    assert plan_parallelism(model, 2, memory_gib=None, seq=SEQ, global_batch=4, device="cpu", candidates=[{"tp": 2}])[0].fits
    assert plan_parallelism.last_memory[1].startswith("this machine's")
    with pytest.raises(fxshard.PlanError, match="no calibration of that name\n  fix: one of"):
        plan_parallelism(model, 2, memory_gib=1, seq=SEQ, global_batch=4, device="tpu-v9")
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(fxshard.PlanError, match="plan before torch.distributed.init_process_group"):
            plan_parallelism(model, 2, memory_gib=1, seq=SEQ, global_batch=4, device="cpu", candidates=[{"tp": 2}])
    finally:
        dist.destroy_process_group()


def test_calibrations_say_where_their_numbers_come_from(tmp_path):
    h100 = Calibration.named("H100")
    assert h100.matmul_tflops == pytest.approx(0.7 * 989) and "data sheet" in h100.source
    assert h100.link("inter").gbps < h100.link("intra").gbps
    measured = calibrate("cpu", repeats=1)
    assert measured.matmul_tflops > 0 and measured.memory_gbps > 0 and "no process group" in measured.source
    path = tmp_path / "cal.json"
    measured.save(str(path))
    assert Calibration.named(str(path)) == measured and json.loads(path.read_text())["dtype"] == "fp32"


def test_the_command_line(capsys, tmp_path):
    from fxshard.__main__ import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama", "--world", "2", "--memory-gib", "1", "--seq", str(SEQ), "--batch", "4",
                 "--device", "cpu", "--candidates", "tp=2;dp=2;pp=2,m=2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3 of 3 candidates fit" in text and "best: torchrun --nproc-per-node 2 -m fxshard train --model llama" in text
    assert {e["trainer_flags"] for e in json.loads(out.read_text())} >= {"--mesh tp=2", "--mesh dp=2",
                                                                         "--mesh pp=2 --microbatches 2 --schedule 1F1B"}
    assert main(["plan", "--model", "llama", "--world", "2"]) == 2
    assert "--seq, --batch missing" in capsys.readouterr().err
    assert main(["plan", "--model", "llama", "--world", "2", "--seq", "8", "--batch", "2", "--memory-gib", "1",
                 "--candidates", "tp=two"]) == 2
    assert "is not AXIS=N" in capsys.readouterr().err


def test_the_loss_backward_at_the_peak():
    """The step's peak is the start of the backward: every kept tensor and the loss's gradients of
    the logits (two fp32 [tokens, vocab] tensors alive in ``cross_entropy``'s backward: nll's and
    log-softmax's, per row; the head's weight gradient once).  Loss parallel holds them per
    vocabulary shard; only the last pipeline stage has them."""
    model = _llama()
    vocab, hidden, rows = model.config.vocab_size, model.config.hidden_size, 4
    planned = PlannedModel.resolve(model)
    dp = program_facts(Captures(planned, SEQ), SubPlan(tp=1)).after.backward_working
    logits_grads = 2 * rows * SEQ * vocab * 4  # fp32
    assert logits_grads <= dp.at(rows) <= logits_grads + vocab * hidden * 4 + 2 * rows * SEQ * hidden * 4
    tp = program_facts(Captures(planned, SEQ), SubPlan(tp=2)).after.backward_working
    assert tp.at(rows) < 0.7 * dp.at(rows)  # the shard's, not the whole vocabulary's
    (flat,) = plan_parallelism(model, 4, memory_gib=1, seq=SEQ, global_batch=4 * rows, device="cpu", dtype="fp32",
                               candidates=[{"dp": 4}])
    assert flat.memory["loss"] == pytest.approx(dp.at(rows), rel=0.01)
    (piped,) = plan_parallelism(model, 4, memory_gib=1, seq=SEQ, global_batch=4 * rows, device="cpu", dtype="fp32",
                                candidates=[{"pp": 2, "dp": 2, "microbatches": 2}])
    first, last = piped.ranks
    assert first.memory["loss"] == 0 and last.memory["loss"] > 0
