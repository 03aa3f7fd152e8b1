"""The planner never crashes on a model the library can shard (issue 42, item 8): uneven
vocabulary shards are planned, and a bug in one sub-plan is an InternalError naming it, on
that sub-plan's entries, while the others are planned."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)
import torch

pytest.importorskip("transformers")

import fxshard  # noqa: E402
from fxshard.planner import api, plan_parallelism  # noqa: E402
from fxshard.planner.facts import Captures, SubPlan, program_facts  # noqa: E402
from fxshard.planner.model import PlannedModel  # noqa: E402

SEQ = 16


def _uneven_llama():
    """12 heads, vocabulary 32000: tp=3 divides the heads, not the vocabulary (10667, 10667, 10666)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=12,
                      num_key_value_heads=12, vocab_size=32000, max_position_embeddings=64)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _llama():
    from fxshard.trainer.models import ModelSource

    source = ModelSource.resolve("llama", {"num_hidden_layers": 2})
    source.positions = SEQ
    return source.build(meta=False)


def test_uneven_vocabulary_shards_are_planned():
    model = _uneven_llama()
    entries = plan_parallelism(model, 3, memory_gib=4, seq=SEQ, global_batch=3, device="cpu",
                               candidates=[{"tp": 3}, {"dp": 3}])
    by_mesh = {e.mesh_spec: e for e in entries}
    assert by_mesh["tp=3"].fits and by_mesh["dp=3"].fits, [e.reason for e in entries]
    assert by_mesh["tp=3"].memory["params"] < by_mesh["dp=3"].memory["params"] * 1.5
    facts = program_facts(Captures(PlannedModel.resolve(model), SEQ), SubPlan(tp=3))
    rows = {shape[0] for u in (facts.before, facts.after) for _, shape, _ in u.params if len(shape) == 2}
    assert 10667 in rows  # rank 0's piece of the vocabulary: torch.chunk's ceil(32000 / 3)


def _broken_for(target: SubPlan, real):
    def broken(captures, sp, *args, **kwargs):
        if sp == target:
            raise KeyError("a bug planted by the test")
        return real(captures, sp, *args, **kwargs)
    return broken


def test_a_bug_in_one_subplan_is_its_internal_error(monkeypatch):
    monkeypatch.setattr(api, "program_facts", _broken_for(SubPlan(tp=2), api.program_facts))
    entries = plan_parallelism(_llama(), 2, memory_gib=4, seq=SEQ, global_batch=4, device="cpu",
                               candidates=[{"tp": 2}, {"dp": 2}, {"tp": 2, "activation_checkpointing": True}])
    by = {(e.mesh_spec, e.activation_checkpointing): e for e in entries}
    assert by[("dp=2", "none")].fits
    for ac in ("none", "full"):
        e = by[("tp=2", ac)]
        assert not e.fits and isinstance(e.error, fxshard.InternalError) and not isinstance(e.error, fxshard.PlanError)
        assert e.error.subplan == SubPlan(tp=2) and "planning sub-plan tp=2: KeyError" in str(e.error)
        assert e.reason.startswith("internal error in sub-plan tp=2 (") and "a bug in fxshard" in e.reason
        assert isinstance(e.error.original, KeyError) and "test_planner_robust.py" not in e.error.location
    assert entries[0].mesh_spec == "dp=2" and entries[0].fits


def test_a_bug_while_building_a_subplans_plan(monkeypatch, capsys):
    real = api.register_plans

    def broken(captures, subplans):
        if SubPlan(tp=2) in subplans:
            raise RuntimeError("plan builder bug")
        return real(captures, subplans)

    monkeypatch.setattr(api, "register_plans", broken)
    from fxshard.__main__ import main

    assert main(["plan", "--model", "llama", "--world", "2", "--memory-gib", "4", "--seq", str(SEQ), "--batch", "4",
                 "--device", "cpu", "--candidates", "tp=2;dp=2"]) == 0
    out = capsys.readouterr()
    assert "1 of 2 candidates fit" in out.out and "rejected: internal error in sub-plan tp=2" in out.out
    assert "sub-plan tp=2 not planned: internal error in pass plan_parallelism" in out.err
    assert "RuntimeError: plan builder bug" in out.err and "--mesh dp=2" in out.out.splitlines()[-1]
