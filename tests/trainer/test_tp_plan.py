"""The trainer's tensor-parallel program is Megatron's: sequence parallel between the tp
regions and a vocabulary-parallel loss (the recipe's ``fxshard.recipe.plan_for_mesh``, which
``fxshard.trainer.parallelize`` transforms).

Read off the transformed program on torch's fake process group (no ranks, seconds):

* around every block the tp axis reduce-scatters and all-gathers, it never all-reduces
  activations; no all-gather has the vocabulary's width (the logits stay vocab shards), and
  the program returns each rank's ``V / tp`` columns;
* MoE blocks (Qwen3-MoE, Mixtral) take whole sequences, gathered on entry;
* a model whose plan sequence parallelism cannot cover falls back to plain TP with a line
  saying why;
* the loss the loop takes on vocab shards (``token_loss_sum(..., vocab_axis=)``) is the
  single-device loss and gradient, -100 padding included (simulated ranks);
* Llama-3.1-8B at seq 8192: the activations a tp=8 rank keeps against a dp=8 rank's.

The numbers of whole runs (every mesh of ``test_train_cli.py`` with SP and loss parallel on)
are held to one process there.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from fxshard.debug.comm_summary import comm_summary  # noqa: E402
from fxshard.planner.offline import offline_mesh  # noqa: E402
from fxshard.recipe.parallel_dims import ParallelDims  # noqa: E402
from fxshard.recipe.plan_for_mesh import plan_for_mesh, sharded_logits  # noqa: E402
from fxshard.trainer.models import ModelSource  # noqa: E402
from fxshard.transform import transform  # noqa: E402

VOCAB, SEQ, LAYERS = 128, 16, 2


def _program(family: str, tp: int = 2, model=None):
    """The trainer's tp program of a tiny ``family`` model, its plan and the log lines."""
    source = ModelSource.resolve(family, {"num_hidden_layers": LAYERS})
    model = model if model is not None else source.build(meta=False, vocab_size=VOCAB)
    lines: list[str] = []
    with offline_mesh({"tp": tp}) as mesh:
        plan = plan_for_mesh(model, ParallelDims(tp=tp, spec=f"tp={tp}"), mesh, log=lines.append)
        program = transform(model, plan, example_kwargs={"input_ids": torch.zeros(2, SEQ, dtype=torch.long)})
        summary = comm_summary(program)
    return model, plan, program, summary, lines


def _forward(summary, kind: str) -> list:
    return [r for r in summary.rows if r.phase == "forward" and r.kind == kind and r.axis == "tp"]


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen3", marks=pytest.mark.sweep),
                                    pytest.param("gemma3_text", marks=pytest.mark.sweep)])
def test_tp_program_is_sequence_and_loss_parallel(family):
    model, plan, program, summary, lines = _program(family)
    assert not lines, lines  # nothing fell back
    assert sharded_logits(plan, model) == ("tp", VOCAB)
    # per block: the attention's and the MLP's input all-gathered, their outputs reduce-scattered
    gathers, scatters = _forward(summary, "all_gather"), _forward(summary, "reduce_scatter")
    assert not _forward(summary, "all_reduce"), [r.region for r in _forward(summary, "all_reduce")]
    assert len(scatters) == 2 * LAYERS + 1  # o_proj, down_proj per block; the vocab-parallel embedding
    assert len(gathers) == 2 * LAYERS + 1  # q|k|v and gate|up per block (one each); the head's input
    assert all(r.shape[-1] != VOCAB for r in gathers), "the logits are gathered"
    head_gather = [r for r in gathers if r.region == "lm_head"]
    assert len(head_gather) == 1 and head_gather[0].shape[-1] == model.config.hidden_size  # the sequence, not the vocab
    from torch.utils._pytree import tree_leaves

    from fxshard.meta import info

    out = [n for n in program.graph.nodes if n.op == "output"][0]
    (logits,) = [a for a in tree_leaves(out.args) if isinstance(a, torch.fx.Node)]
    assert tuple(info(logits).value.local_shape)[-1] == VOCAB // 2  # each rank returns its vocab shard


@pytest.mark.parametrize("family", ["qwen3_moe", pytest.param("mixtral", marks=pytest.mark.sweep)])
def test_moe_blocks_take_whole_sequences(family):
    model, plan, _, summary, lines = _program(family)
    assert not lines, lines
    moe = plan.specs["model.layers.*.mlp"]
    assert moe.style.startswith("sequence_parallel (MoE block")
    gathered = [r for r in _forward(summary, "all_gather") if r.region.endswith(".mlp")]
    assert len(gathered) == LAYERS
    assert sharded_logits(plan, model) == ("tp", VOCAB)


def test_plain_tp_when_sequence_parallel_cannot_cover_the_model():
    """A rowwise LM head (no vocab shards to keep, no sequence to gather): plain TP, said once."""
    source = ModelSource.resolve("llama", {"num_hidden_layers": LAYERS})
    model = source.build(meta=False, vocab_size=VOCAB)
    model.tp_plan = {**model.tp_plan, "lm_head": "rowwise_split_input"}
    model.config.tie_word_embeddings = False
    _, plan, _, summary, lines = _program("llama", model=model)
    assert len(lines) == 1 and lines[0].startswith("tp: plain tensor parallel") and "LM head" in lines[0], lines
    assert sharded_logits(plan, model) is None
    assert not _forward(summary, "reduce_scatter")  # plain TP: all-reduces


def test_vocab_parallel_token_loss_is_the_single_device_loss():
    """``token_loss_sum`` on vocab shards (simulated ranks, uneven 2 x 61 + 1 -> 63/60 columns):
    the summed token loss and the logits' gradient of one device, -100 padding skipped."""
    from tests.harness import simulated
    from torch.distributed._local_tensor import LocalTensor

    from fxshard.runtime.collectives import bind_mesh
    from fxshard.training.token_loss import token_loss_sum

    torch.manual_seed(0)
    vocab = 123
    logits = torch.randn(2, 5, vocab, dtype=torch.float64)
    labels = torch.randint(0, vocab, (2, 5))
    labels[0, :2] = -100
    full = logits.clone().requires_grad_(True)
    want = token_loss_sum(full, labels)
    want.backward()
    with simulated({"tp": 2}) as mesh:
        previous = bind_mesh(mesh)
        try:
            pieces = logits.chunk(2, -1)
            local = LocalTensor({r: pieces[r].clone() for r in range(2)}).requires_grad_(True)
            got = token_loss_sum(local, labels, "tp", vocab)
            got.backward()
            for r in range(2):
                torch.testing.assert_close(got._local_tensors[r], want.detach())
                torch.testing.assert_close(local.grad._local_tensors[r], full.grad.chunk(2, -1)[r])
        finally:
            bind_mesh(previous)


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
            "tie_word_embeddings": False}


def llama_8b_activations(config_dir, seq: int = 8192) -> dict[str, float]:
    """Bytes of activations a rank keeps for the backward (bf16, one row of ``seq`` tokens per
    rank), Llama-3.1-8B on the meta device, by the planner's facts: ``{"dp=8": ..., "tp=8": ...}``
    (a dp rank runs the unsharded program)."""
    from fxshard.planner.facts import Captures, SubPlan, program_facts, register_plans
    from fxshard.planner.model import PlannedModel

    planned = PlannedModel.resolve(str(config_dir / "config.json"))
    captures = Captures(planned, seq)
    subplans = {"dp=8": SubPlan(), "tp=8": SubPlan(tp=8)}
    assert not register_plans(captures, subplans.values())
    out = {}
    for name, sp in subplans.items():
        facts = program_facts(captures, sp, dtype=torch.bfloat16)
        units = [facts.before, *(facts.block(i) for i in range(facts.n_blocks)), facts.after]
        out[name] = sum(u.saved.at(1) for u in units)
    return out


def test_llama_8b_tp8_activations_against_dp8(tmp_path):
    """Sequence + loss parallel, and the column-parallel linears keeping their input's shard
    (gathered again in the backward, Megatron's way), divide what a tp=8 rank keeps by more
    than 5 (issue 42's bar: at most 0.2 of dp=8's; docs/trainer.md: 0.173; 0.232 when the
    linears kept the gathered inputs, 0.470 with neither SP nor loss parallel)."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    act = llama_8b_activations(tmp_path)
    ratio = act["tp=8"] / act["dp=8"]
    assert 55 * 2**30 < act["dp=8"] < 65 * 2**30, act
    assert ratio <= 0.2, (ratio, act)
