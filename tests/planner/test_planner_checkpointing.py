"""The planner's activation checkpointing modes (docs/planning.md): each of ``none``,
``selective`` (torchtitan's per-op policy, its saved bytes measured on the meta device with the
trainer's own policy) and ``full`` predicted, for Llama-3.1-8B at 8192 tokens (config.json only,
the meta device): activations none > selective > full, and the step the other way round."""
import json

import pytest

pytest.importorskip("transformers")

from fxshard.planner import plan_parallelism
from fxshard.planner.candidates import Candidate, enumerate_candidates

LLAMA_31_8B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                   max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8)
MODES = ("none", "selective", "full")


def test_llama_8b_modes_are_ordered(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    entries = plan_parallelism(str(tmp_path), 8, memory_gib=1000, seq=8192, global_batch=8, device="h100", dtype="bf16",
                               candidates=[{"dp": 8, "activation_checkpointing": m} for m in MODES])
    by = {e.activation_checkpointing: e for e in entries}
    assert set(by) == set(MODES) and all(e.fits for e in entries)
    act = {m: by[m].memory["activations"] / 2**30 for m in MODES}
    assert act["none"] > act["selective"] > act["full"], act
    # selective keeps the matmul / attention outputs: well above full's block inputs, well below everything
    assert 1.5 * act["full"] < act["selective"] < 0.6 * act["none"], act
    step = {m: by[m].step_time_s for m in MODES}
    assert step["none"] < step["selective"] < step["full"], step
    assert by["selective"].trainer_flags() == "--mesh dp=8 --activation-checkpointing selective"
    assert by["none"].trainer_flags() == "--mesh dp=8"


def test_candidates_try_each_mode():
    cands = enumerate_candidates(8, seq=8192, global_batch=8, n_blocks=32, heads=32, experts=None, gpus_per_node=8)
    assert {c.activation_checkpointing for c in cands} == set(MODES)
    assert Candidate.make({"dp": 8}, activation_checkpointing=True).activation_checkpointing == "full"
    assert Candidate.make({"dp": 8}, activation_checkpointing="selective:2").checkpointing == ("full", 2)
