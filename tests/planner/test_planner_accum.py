"""Gradient accumulation as a planner dimension (issue 42, item 4): a candidate runs each dp
rank's rows in ``accum`` passes, its memory is one pass's activations (plus FSDP2's
accumulated unsharded gradients), its time counts the passes, and the planner takes the
fewest passes that fit."""
from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.isolated  # torch's fake process group, process-wide (pyproject: markers)

pytest.importorskip("transformers")

from fxshard.planner import plan_parallelism  # noqa: E402
from fxshard.planner.candidates import accum_choices, candidate_from, divisibility  # noqa: E402
from fxshard.trainer.models import ModelSource  # noqa: E402

GIB = 1 << 30
SEQ = 16
LLAMA_70B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_size=8192,
                 intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)


def _llama(layers: int = 2):
    source = ModelSource.resolve("llama", {"num_hidden_layers": layers})
    source.positions = SEQ
    return source.build(meta=False)


def test_candidate_accum_rules_and_flags():
    c = candidate_from({"tp": 2, "accum": 4}, 8)
    assert (c.mesh["dp"], c.accum) == (4, 4) and c.micro_rows(32) == 2
    assert c.trainer_flags() == "--mesh dp=4,tp=2 --accum 4"
    assert divisibility(c, 8, seq=SEQ, global_batch=32, n_blocks=2, heads=4, experts=None) is None
    assert divisibility(c, 8, seq=SEQ, global_batch=8, n_blocks=2, heads=4, experts=None) == \
        "accum=4 passes do not divide each dp rank's 2 rows"
    pp = candidate_from({"pp": 2, "microbatches": 4, "accum": 2}, 4)
    assert divisibility(pp, 4, seq=SEQ, global_batch=8, n_blocks=2, heads=4, experts=None) == \
        "4 micro-batches do not divide each pass's 2 rows"
    assert accum_choices(pp, 16) == [1, 2] and accum_choices(candidate_from({"dp": 2}, 2), 12) == [1, 2, 3, 6]
    assert pp.with_accum(1).key != pp.key and pp.trainer_flags().startswith("--mesh pp=2,dp=2 --accum 2 --microbatches 4")
    assert "--accum" not in pp.with_accum(1).trainer_flags()


def test_more_passes_less_activation_memory_more_time():
    model = _llama()
    by_accum = {e.accum: e for e in plan_parallelism(model, 2, memory_gib=100, seq=SEQ, global_batch=16, device="cpu",
                                                    candidates=[{"dp": 2, "accum": a} for a in (1, 2, 4, 8)])}
    assert all(e.fits for e in by_accum.values()) and sorted(by_accum) == [1, 2, 4, 8]
    acts = [by_accum[a].memory["activations"] for a in (1, 2, 4, 8)]
    assert acts == sorted(acts, reverse=True) and acts[0] > 1.5 * acts[1]
    # FSDP2 under no_sync keeps the unsharded gradients between the passes
    assert by_accum[1].memory["grads"] == by_accum[1].memory["params"]
    assert by_accum[2].memory["grads"] > 1.9 * by_accum[2].memory["params"]
    assert by_accum[2].memory["grads"] == by_accum[8].memory["grads"]
    times = [by_accum[a].step_time_s for a in (1, 2, 4, 8)]
    assert times == sorted(times)
    # each pass all-gathers again, the reduce-scatter once
    assert by_accum[1].comm_bytes["dp"] < by_accum[2].comm_bytes["dp"] < by_accum[4].comm_bytes["dp"]


def test_the_fewest_passes_that_fit_are_chosen():
    model = _llama()
    wide = plan_parallelism(model, 2, memory_gib=100, seq=SEQ, global_batch=16, device="cpu",
                            candidates=[{"dp": 2, "accum": a} for a in (1, 2, 4, 8)])
    mem = {e.accum: e.memory["total"] / GIB for e in wide}
    budget = (mem[2] + mem[4]) / 2  # fits in 4 passes, not in 2
    assert mem[1] > budget and mem[2] > budget and mem[4] < budget
    chosen = plan_parallelism(model, 2, memory_gib=budget, seq=SEQ, global_batch=16, device="cpu",
                              candidates=[{"dp": 2, "accum_grads": "unsharded"}])[0]
    assert chosen.fits and chosen.accum == 4 and chosen.trainer_flags() == "--mesh dp=2 --accum 4"
    assert chosen.memory["total"] == pytest.approx(mem[4] * GIB)
    # free to reduce-scatter every pass, FSDP2's gradients accumulate sharded: fewer passes fit, and are taken
    # where the planner predicts them faster
    free = plan_parallelism(model, 2, memory_gib=budget, seq=SEQ, global_batch=16, device="cpu", candidates=[{"dp": 2}])[0]
    assert free.fits and free.step_time_s <= chosen.step_time_s
    assert free.accum == 4 or (free.accum < 4 and free.trainer_flags().endswith("--accum-grads sharded")), free
    fixed = plan_parallelism(model, 2, memory_gib=budget, seq=SEQ, global_batch=16, device="cpu", candidates=[{"dp": 2}],
                             accum=1)[0]
    assert not fixed.fits and fixed.accum == 1 and fixed.reason.startswith("memory: ")
    none = plan_parallelism(model, 2, memory_gib=mem[8] / 2, seq=SEQ, global_batch=16, device="cpu",
                            candidates=[{"dp": 2}])[0]
    assert not none.fits and none.accum == 8 and "in 8 accumulation passes, the most" in none.reason


def test_llama_70b_at_dp8_tp8_fits_by_accumulating(tmp_path):
    """The published mesh of torchtitan's Llama-3-70B (FSDP 8 x TP 8, global batch 256 x 8192)
    on 80 GiB: in one pass each rank's 32 rows are far too many; in several passes it fits."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    mesh = {"dp": 8, "tp": 8, "activation_checkpointing": True}
    one, auto = plan_parallelism(str(tmp_path), 64, memory_gib=80, seq=8192, global_batch=256, device="h100",
                                 candidates=[dict(mesh, accum=1), mesh])
    one, auto = sorted((one, auto), key=lambda e: e.accum)
    assert one.accum == 1 and not one.fits and one.memory["total"] > 80 * GIB
    assert auto.fits and auto.accum > 1 and auto.memory["total"] <= 80 * GIB, auto.reason
    assert f"--accum {auto.accum}" in auto.trainer_flags()
    assert auto.memory["activations"] < one.memory["activations"] / auto.accum * 1.5
    assert os.environ.get("WORLD_SIZE") is None  # planned in this process alone
