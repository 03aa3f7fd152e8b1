"""HuggingFace transformers models, captured with torch.export and sharded with their
own tensor-parallel plans (``Plan.from_hf``): logits, the model's own loss, parameter
gradients and the outputs after 2 SGD steps equal the single-device model, in
simulated ranks (tp=2, tp=4) and in real gloo processes (tp=2)."""
import functools

import pytest
import torch
from torch.distributed.tensor import Shard

transformers = pytest.importorskip("transformers")

import fxshard
from equivalence import Case, check_real_cases, check_simulated, cross_entropy
from fxshard.testing.hf_tiny import tiny_inputs
from fxshard.meta import program_meta

V = 128
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


def _config(family: str, tp: int):
    """Tiny configs; tp=4 shards 4 kv heads (HF's plans shard k/v by heads)."""
    heads = dict(num_attention_heads=8, num_key_value_heads=4) if tp == 4 else {}
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4 * (2 if tp == 4 else 1), n_positions=64,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "phi3": transformers.Phi3Config, "gemma": transformers.GemmaConfig, "mistral": transformers.MistralConfig}[family]
    return cls(**{**COMMON, **heads})


def hf_model(family: str, tp: int = 2):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(family, tp))


def hf_plan(mesh, family, tp=2, **flags):
    return fxshard.Plan.from_hf(mesh, hf_model(family, tp), **flags)


def logits(out):
    return out.logits


def model_loss(out):
    return out.loss


def _batch(b=2, s=8, seed=0):
    """Ids and labels: distinct tensors, labels with -100 on the prompt and at random (tiny_inputs)."""
    ids, labels = tiny_inputs(b, s, V, seed=seed)
    return {"input_ids": ids, "labels": labels}


BATCH = _batch()
CHECK = dict(select=logits, loss_fn=model_loss, replicated_loss=True, lr=0.2)

# Llama (GQA, SwiGLU), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms), Phi3 (fused qkv_proj,
# gate_up_proj), Gemma (tied head, scaled embedding), GPT-2 (Conv1D, fused c_attn, tied head);
# Mistral is one the issue does not name.
FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gemma", "gpt2", "mistral"]


@pytest.mark.parametrize("family,tp", [(f, 2) for f in FAMILIES] + [(f, 4) for f in ("llama", "qwen2", "gpt2")])
def test_hf_family_simulated(family, tp):
    sharded = check_simulated(functools.partial(hf_model, family, tp), functools.partial(hf_plan, family=family, tp=tp),
                              (), {"tp": tp}, kwargs=BATCH, **CHECK)
    assert program_meta(sharded).captured_by == "torch.export"
    assert "CausalLMOutput" in str(sharded.graph._codegen.pytree_info.out_spec)  # the model's ModelOutput


@pytest.mark.parametrize("flags", [dict(sequence_parallel=True), dict(loss_parallel=True),
                                   dict(sequence_parallel=True, loss_parallel=True)], ids=["sp", "lp", "sp+lp"])
def test_hf_llama_sequence_and_loss_parallel(flags):
    sharded = check_simulated(functools.partial(hf_model, "llama"), functools.partial(hf_plan, family="llama", **flags),
                              (), {"tp": 2}, kwargs=BATCH, **CHECK)
    summary = fxshard.comm_summary(sharded)
    if flags.get("sequence_parallel"):
        assert "reduce_scatter" in str(summary)
    if flags.get("loss_parallel"):
        (out,) = [n for n in sharded.graph.nodes if n.op == "output"]
        logit_node = out.args[0][1]
        assert logit_node.meta["fxshard"].value.local_shape[-1] == V // 2  # full logits are never gathered


def test_hf_runs_at_other_batch_and_sequence_sizes():
    other = _batch(3, 5, seed=1)
    check_simulated(functools.partial(hf_model, "llama"), functools.partial(hf_plan, family="llama", sequence_parallel=False),
                    (), {"tp": 2}, kwargs=other, example_kwargs=BATCH, **CHECK)


def test_hf_example_batch_of_one_stays_dynamic():
    """export specializes size-1 dims; fxshard captures on a grown copy, so a batch of
    one as the example still gives a graph that runs at any batch size."""
    one = _batch(1, 8)
    check_simulated(functools.partial(hf_model, "qwen2"), functools.partial(hf_plan, family="qwen2"), (), {"tp": 2},
                    kwargs=BATCH, example_kwargs=one, **CHECK)


def test_hf_input_model_is_untouched():
    model = hf_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = fxshard.Plan.from_hf(fxshard.MeshSpec(("tp",), (2,)), model)
    sharded = fxshard.transform(model, plan, example_kwargs=BATCH)
    assert model.config.use_cache is True and not model._forward_hooks and not model._forward_pre_hooks
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert set(sharded.state_dict()) == set(model.state_dict())  # FQNs are the model's
    assert "fx_pytree.tree_flatten_spec" in sharded.code and "fxshard_all_reduce" in sharded.code


def test_hf_wrong_plan_is_a_plan_error():
    model = hf_model("llama")
    mesh = fxshard.MeshSpec(("tp",), (2,))
    plan = fxshard.Plan(mesh, {"model.layers.*.self_attn.q_proj": fxshard.rowwise()})  # input is not sharded
    with pytest.raises(fxshard.PlanError) as err:
        fxshard.transform(model, plan, example_kwargs=BATCH)
    msg = str(err.value)
    assert "model.layers.0.self_attn.q_proj" in msg and "fix:" in msg and "'tp'" in msg
    # 4 heads of 16 on 3 ranks: torch.chunk pieces of 22, 22, 20 features, which the heads view cannot regroup
    bad_width = fxshard.Plan(fxshard.MeshSpec(("tp",), (3,)), {f"model.layers.*.self_attn.{p}_proj": fxshard.colwise() for p in "qkv"})
    with pytest.raises(fxshard.PlanError, match=r"unequal pieces \(22, 22, 20\).*\n.*\n.*fix: .*divides 64"):
        fxshard.transform(model, bad_width, example_kwargs=BATCH)


@pytest.mark.sweep  # ~100 s of 4 real ranks on 2 cores: .ci/run's second stage (the main stage's 30 minutes)
def test_hf_families_real_gloo():
    """One real gloo tp=2 run per family, in one spawn (spawning costs seconds)."""
    cases = [Case(functools.partial(hf_model, f), functools.partial(hf_plan, family=f), (), {"tp": 2}, kwargs=BATCH,
                  name=f"hf {f}", **CHECK) for f in FAMILIES]
    cases.append(Case(functools.partial(hf_model, "llama"), functools.partial(hf_plan, family="llama", sequence_parallel=True,
                                                                               loss_parallel=True),
                      (), {"tp": 2}, kwargs=BATCH, name="hf llama sp+lp", **CHECK))
    check_real_cases(2, cases)


def _dp_tp_plan(mesh, family):
    return fxshard.Plan.from_hf(mesh, hf_model(family)).replace(inputs={"input_ids": {"dp": Shard(0)}})


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3"])
def test_hf_batch_sharded_over_dp_with_tp(family):
    """dp x tp with the batch sharded on dp: HF's mask builder reads ``arange(batch)`` of the
    rank's own rows (Shard(0) plus the rank's offset) and indexes with it; GPT-2's fused
    c_attn keeps its parts through the [B*S, 3H] -> [B, S, 3H] view of a dp-sharded batch."""
    ids, tgt = tiny_inputs(4, 8, V, seed=3)  # targets with -100 padding: F.cross_entropy skips them
    sharded = check_simulated(functools.partial(hf_model, family), functools.partial(_dp_tp_plan, family=family), (),
                              {"dp": 2, "tp": 2}, kwargs={"input_ids": ids}, select=logits, loss_fn=cross_entropy,
                              targets=(tgt,), lr=0.2)
    # one bucket over dp (GPT-2's Conv1D weights, read as w.t(), in it too); GPT-2's learned positions, the
    # same on every dp rank, get their activation's gradient summed on its own
    want = 2 if family == "gpt2" else 1
    assert fxshard.comm_summary(sharded).count("backward", "all_reduce", axis="dp") == want
