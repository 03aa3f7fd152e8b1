"""Plan.from_hf: the TP plans transformers models ship (config.base_model_tp_plan, the
head's _tp_plan), as fxshard specs; GPT-2's, which HF lacks, from fxshard; ties, sequence
and loss parallelism on top; routed experts from the tp and ep plans; unknown styles refused."""
from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import types
from dataclasses import replace

import pytest

transformers = pytest.importorskip("transformers")

import torch
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard import MeshSpec, ModuleSpec, Plan, PlanError, colwise, routed_experts, rowwise, sequence_parallel, vocab_parallel
from fxshard.plan.importers.hf_plan import KNOWN_STYLES, hf_tp_plan, param_layout, specs_from_hf, style_spec
from fxshard.plan.specs import for_module_type

TP2 = MeshSpec(("tp",), (2,))
R = Replicate()
SEQ = {"tp": Shard(1)}
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, use_cache=False)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()  # tiny vocabularies make config warnings about special token ids
    yield
    logging.set_verbosity(level)


def build(config_name: str, model_name: str, **kw) -> nn.Module:
    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**{**SMALL, **kw}))


def gpt2(model_name: str = "GPT2LMHeadModel") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    return getattr(transformers, model_name)(config)


def hf(spec: ModuleSpec, style: str) -> ModuleSpec:
    return replace(spec, style=style)


def fqns(model) -> list[str]:
    return [n for n, _ in model.named_modules()]


def llama_specs(prefix: str = "model.") -> dict[str, ModuleSpec]:
    """HF's Llama plan (plus its default vocab-parallel embed_tokens) in fxshard's words."""
    att, mlp = f"{prefix}layers.*.self_attn", f"{prefix}layers.*.mlp"
    return {
        f"{prefix}embed_tokens": hf(vocab_parallel("tp"), "embedding_rowwise"),
        **{f"{att}.{p}": hf(colwise("tp"), "colwise") for p in ("q_proj", "k_proj", "v_proj")},
        f"{att}.o_proj": hf(rowwise("tp"), "rowwise"),
        **{f"{mlp}.{p}": hf(colwise("tp"), "colwise") for p in ("gate_proj", "up_proj")},
        f"{mlp}.down_proj": hf(rowwise("tp"), "rowwise"),
    }


@pytest.fixture(scope="module")
def llama():
    return build("LlamaConfig", "LlamaForCausalLM")


# ----------------------------------------------------------------------------- families


def test_llama_head_model(llama):
    plan = Plan.from_hf(TP2, llama)
    expected = {**llama_specs(), "lm_head": hf(colwise("tp", out=R), "colwise_gather_output")}
    assert plan.specs == expected
    assert list(plan.specs)[0] == "model.embed_tokens" and list(plan.specs)[-1] == "lm_head"  # model order
    assert plan.specs["model.layers.*.self_attn.q_proj"].params["weight"] == {"tp": Shard(0)}
    assert plan.specs["model.layers.*.self_attn.o_proj"].params == {"weight": {"tp": Shard(1)}}  # bias after the reduction
    plan.check_patterns(fqns(llama))  # every entry matches a module


def test_llama_base_model_has_no_prefix(llama):
    plan = Plan.from_hf(TP2, llama.model)
    assert plan.specs == llama_specs(prefix="")


def test_repr_names_hf_styles(llama):
    text = repr(Plan.from_hf(TP2, llama))
    assert "'lm_head': ModuleSpec(style='colwise_gather_output'" in text
    assert "'model.embed_tokens': ModuleSpec(style='embedding_rowwise'" in text


def test_plan_from_hf_function_and_subclass(llama):
    class MyPlan(Plan):
        pass

    assert specs_from_hf(TP2, llama).specs == Plan.from_hf(TP2, llama).specs
    assert type(MyPlan.from_hf(TP2, llama)) is MyPlan


def test_qwen2_biases_are_sharded_with_their_weight():
    model = build("Qwen2Config", "Qwen2ForCausalLM")
    plan = Plan.from_hf(TP2, model)
    assert plan.specs == {**llama_specs(), "lm_head": hf(colwise("tp", out=R), "colwise_gather_output")}
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    assert plan.specs["model.layers.*.self_attn.q_proj"].params["bias"] == {"tp": Shard(0)}


def test_qwen3_per_head_norms_change_nothing():
    model = build("Qwen3Config", "Qwen3ForCausalLM", head_dim=16)
    plan = Plan.from_hf(TP2, model)
    for norm in ("q_norm", "k_norm"):
        spec = plan.specs[f"model.layers.*.self_attn.{norm}"]
        assert spec == ModuleSpec(style="replicated_with_grad_allreduce")  # grad-sync sums their gradients
        assert not spec.declares_boundary() and not spec.params
    plan.check_patterns(fqns(model))


def test_phi3_fused_projections_gather_their_output():
    model = build("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)
    plan = Plan.from_hf(TP2, model)
    att, mlp = "model.layers.*.self_attn", "model.layers.*.mlp"
    assert plan.specs[f"{att}.qkv_proj"] == hf(colwise("tp", out=R), "colwise_gather_output")
    assert plan.specs[f"{att}.o_proj"] == hf(rowwise("tp", inputs=R), "rowwise_split_input")
    assert plan.specs[f"{mlp}.gate_up_proj"] == hf(colwise("tp", out=R), "colwise_gather_output")
    assert plan.specs[f"{mlp}.down_proj"] == hf(rowwise("tp", inputs=R), "rowwise_split_input")
    assert plan.specs[f"{att}.o_proj"].in_src == {"tp": R}  # replicated on entry: chunked locally
    plan.check_patterns(fqns(model))


def test_gemma_tied_head_and_embedding_agree():
    model = build("GemmaConfig", "GemmaForCausalLM", head_dim=16)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    plan = Plan.from_hf(TP2, model)
    assert plan.specs["model.embed_tokens"].params["weight"] == plan.specs["lm_head"].params["weight"] == {"tp": Shard(0)}


# ----------------------------------------------------------------------------- GPT-2 (fxshard's plan, Conv1D)


def test_gpt2_lm_head_model():
    model = gpt2()
    assert hf_tp_plan(model)["transformer.h.*.attn.c_attn"] == ("packed_colwise", 3)  # HF has none: fxshard's
    plan = Plan.from_hf(TP2, model)
    s = plan.specs
    assert list(s) == ["transformer.wte", "transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
                       "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj", "lm_head"]
    # Conv1D: weight [in, out], so colwise shards weight dim 1 and the bias, rowwise weight dim 0
    assert s["transformer.h.*.attn.c_attn"].params == {"weight": {"tp": Shard(1)}, "bias": {"tp": Shard(0)}}
    assert s["transformer.h.*.attn.c_attn"].splits == (64, 64, 64)  # q | k | v, each sharded
    assert s["transformer.h.*.mlp.c_fc"].params == {"weight": {"tp": Shard(1)}, "bias": {"tp": Shard(0)}}
    assert s["transformer.h.*.mlp.c_fc"].splits is None
    for proj in ("attn.c_proj", "mlp.c_proj"):
        assert s[f"transformer.h.*.{proj}"].params == {"weight": {"tp": Shard(0)}}
        assert s[f"transformer.h.*.{proj}"].out_src == {"tp": Partial()}
    assert s["transformer.h.*.attn.c_attn"].in_src == {"tp": R} and s["transformer.h.*.attn.c_attn"].out_dst == {"tp": Shard(-1)}
    # tied lm_head (nn.Linear) and wte: both vocab-sharded
    assert model.lm_head.weight is model.transformer.wte.weight
    assert s["transformer.wte"].params == {"weight": {"tp": Shard(0)}} and s["lm_head"].params["weight"] == {"tp": Shard(0)}
    assert s["lm_head"].out_dst == {"tp": R}
    plan.check_patterns(fqns(model))


def test_gpt2_base_model():
    plan = Plan.from_hf(TP2, gpt2("GPT2Model"))
    assert list(plan.specs) == ["wte", "h.*.attn.c_attn", "h.*.attn.c_proj", "h.*.mlp.c_fc", "h.*.mlp.c_proj"]


def test_conv1d_presets():
    from transformers.pytorch_utils import Conv1D

    col, row = for_module_type(colwise(), Conv1D), for_module_type(rowwise(out=Shard(1)), Conv1D)
    assert col.params == {"weight": {"tp": Shard(1)}, "bias": {"tp": Shard(0)}}
    assert (col.inputs, col.out_src) == (colwise().inputs, colwise().out_src)  # boundaries as for nn.Linear
    assert row.params == {"weight": {"tp": Shard(0)}} and row.out_dst == {"tp": Shard(1)}
    Duck = type("Conv1D", (nn.Module,), {})  # known by name: fxshard never imports transformers
    assert for_module_type(colwise(), Duck).params["weight"] == {"tp": Shard(1)}
    assert for_module_type(colwise(), nn.Conv1d) == colwise()  # torch's convolution is not GPT-2's Conv1D


# ----------------------------------------------------------------------------- ties


def _tied_llama(drop: str | None = None, **override) -> nn.Module:
    model = build("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = {k: v for k, v in model.tp_plan.items() if k != drop}
    model.tp_plan = {**plan, **override}
    return model


def test_tied_head_gives_the_embedding_its_layout():
    plan = Plan.from_hf(TP2, _tied_llama(drop="model.embed_tokens"))
    assert plan.specs["model.embed_tokens"] == hf(vocab_parallel("tp"), "embedding_rowwise (tied to lm_head)")


def test_tied_embedding_gives_the_head_its_layout():
    plan = Plan.from_hf(TP2, _tied_llama(drop="lm_head"))
    assert plan.specs["lm_head"] == hf(colwise("tp", out=R), "colwise_gather_output (tied to model.embed_tokens)")


def test_tied_replicated_embedding_follows_a_rowwise_head():
    plan = Plan.from_hf(TP2, _tied_llama(drop="model.embed_tokens", lm_head="rowwise_split_input"))
    assert plan.specs["model.embed_tokens"].params == {"weight": {"tp": Shard(1)}}  # the same dim of the same tensor


def test_tied_conflicting_layouts_are_plan_errors():
    with pytest.raises(PlanError, match=r"'lm_head' is tied to 'model.embed_tokens'.*embedding_colwise"):
        Plan.from_hf(TP2, _tied_llama(**{"model.embed_tokens": "embedding_colwise"}))


# ----------------------------------------------------------------------------- sequence / loss parallel


def _sp(spec: ModuleSpec, colwise_family: bool) -> ModuleSpec:
    return replace(spec, in_src=SEQ) if colwise_family else replace(spec, out_dst=SEQ)


def test_llama_sequence_parallel(llama):
    plan = Plan.from_hf(TP2, llama, sequence_parallel=True)
    expected = {k: _sp(v, v.style == "colwise") for k, v in llama_specs().items() if "layers" in k}
    expected.update({
        "model.embed_tokens": hf(vocab_parallel("tp", out=Shard(1)), "embedding_rowwise"),  # reduce-scatter
        "model.layers.*.input_layernorm": sequence_parallel("tp"),
        "model.layers.*.post_attention_layernorm": sequence_parallel("tp"),
        "model.norm": sequence_parallel("tp"),
        "lm_head": hf(colwise("tp", inputs=Shard(1), out=R), "colwise_gather_output"),  # gathers the sequence
    })
    assert plan.specs == expected
    assert plan.specs["model.layers.*.self_attn.q_proj"].inputs == {"tp": R}  # all-gathered on entry
    assert plan.specs["model.layers.*.mlp.down_proj"].out_dst == SEQ  # reduce-scatter
    plan.check_patterns(fqns(llama))


def test_sequence_parallel_base_model_gathers_after_the_final_norm(llama):
    plan = Plan.from_hf(TP2, llama.model, sequence_parallel=True)
    assert plan.specs["norm"] == replace(sequence_parallel("tp"), out_dst={"tp": R})
    assert plan.specs["layers.*.input_layernorm"] == sequence_parallel("tp")


def test_sequence_parallel_skips_per_head_norms():
    model = build("Qwen3Config", "Qwen3ForCausalLM", head_dim=16)
    plan = Plan.from_hf(TP2, model, sequence_parallel=True)
    assert plan.specs["model.layers.*.self_attn.q_norm"] == ModuleSpec(style="replicated_with_grad_allreduce")
    assert plan.specs["model.layers.*.input_layernorm"] == sequence_parallel("tp")


def test_phi3_sequence_parallel_keeps_gathered_outputs():
    model = build("Phi3Config", "Phi3ForCausalLM", pad_token_id=0)
    s = Plan.from_hf(TP2, model, sequence_parallel=True).specs
    assert s["model.layers.*.self_attn.qkv_proj"] == hf(colwise("tp", inputs=Shard(1), out=R), "colwise_gather_output")
    assert s["model.layers.*.self_attn.o_proj"] == hf(rowwise("tp", inputs=R, out=Shard(1)), "rowwise_split_input")


def test_gpt2_sequence_parallel_slices_the_positions():
    model = gpt2()
    s = Plan.from_hf(TP2, model, sequence_parallel=True).specs
    assert s["transformer.wte"].out_dst == SEQ and s["transformer.wte"].out_src == {"tp": Partial()}
    # positions [1, S, D] are added to the tokens [B, S, D]: sliced like them, no communication
    assert s["transformer.wpe"] == ModuleSpec(out_dst=SEQ, style="sequence_shard")
    for norm in ("transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"):
        assert s[norm] == sequence_parallel("tp")
    assert s["transformer.h.*.attn.c_attn"].in_src == SEQ and s["transformer.h.*.attn.c_attn"].splits == (64, 64, 64)
    assert s["transformer.h.*.mlp.c_proj"].out_dst == SEQ
    assert s["lm_head"].in_src == SEQ


def test_sequence_parallel_replicated_embedding_is_sliced():
    model = build("LlamaConfig", "LlamaForCausalLM")
    model.tp_plan = {**model.tp_plan, "model.embed_tokens": "replicate"}
    s = Plan.from_hf(TP2, model, sequence_parallel=True).specs
    assert s["model.embed_tokens"] == ModuleSpec(out_dst=SEQ, style="replicate")


def test_loss_parallel(llama):
    s = Plan.from_hf(TP2, llama, loss_parallel=True).specs
    assert s["lm_head"] == hf(colwise("tp", out=Shard(-1)), "colwise (loss parallel)")
    both = Plan.from_hf(TP2, llama, loss_parallel=True, sequence_parallel=True).specs
    assert both["lm_head"] == hf(colwise("tp", inputs=Shard(1), out=Shard(-1)), "colwise (loss parallel)")


def test_loss_parallel_needs_a_head(llama):
    with pytest.raises(PlanError, match=r"loss_parallel=True.*LlamaModel has no LM head"):
        Plan.from_hf(TP2, llama.model, loss_parallel=True)


# ----------------------------------------------------------------------------- what HF plans hold


def test_entries_for_missing_modules_are_dropped(monkeypatch):
    plan = dict(transformers.LlamaConfig.base_model_tp_plan, **{"layers.*.mlp.shared_expert.gate_proj": "colwise"})
    monkeypatch.setattr(transformers.LlamaConfig, "base_model_tp_plan", plan)
    model = build("LlamaConfig", "LlamaForCausalLM")
    assert "model.layers.*.mlp.shared_expert.gate_proj" in hf_tp_plan(model)
    specs = Plan.from_hf(TP2, model)
    assert not any("shared_expert" in k for k in specs.specs)
    specs.check_patterns(fqns(model))


def test_parameter_entries_go_to_their_module():
    model = build("GraniteSWAConfig", "GraniteSWAForCausalLM")
    assert hf_tp_plan(model)["model.layers.*.self_attn.sinks"] == "colwise"
    spec = Plan.from_hf(TP2, model).specs["model.layers.*.self_attn"]
    assert spec == ModuleSpec(params={"sinks": {"tp": Shard(0)}}, style="local_params")  # HF: Shard(ndim - 2)


def test_param_layouts():
    bias, weight = torch.zeros(8), torch.zeros(8, 4)
    assert param_layout("colwise", weight, "weight") == Shard(0)
    assert param_layout("rowwise", weight, "weight") == Shard(1)
    assert param_layout("rowwise", bias, "bias") == R
    assert param_layout("replicated_with_grad_allreduce", bias, "weight") == R
    with pytest.raises(PlanError, match="only as routed experts"):
        param_layout("rowwise", torch.zeros(2, 8, 4), "down_proj", "layers.*.mlp.experts.down_proj")


def test_unknown_style_is_a_plan_error(monkeypatch):
    plan = dict(transformers.LlamaConfig.base_model_tp_plan, **{"layers.*.mlp.up_proj": "colwise_fancy"})
    monkeypatch.setattr(transformers.LlamaConfig, "base_model_tp_plan", plan)
    model = build("LlamaConfig", "LlamaForCausalLM")
    with pytest.raises(PlanError, match=r"'model.layers.\*.mlp.up_proj'.*unknown HF parallel style 'colwise_fancy'.*'rowwise_split_input'"):
        Plan.from_hf(TP2, model)


def test_moe_style_on_a_dense_module_is_a_plan_error(monkeypatch):
    plan = dict(transformers.LlamaConfig.base_model_tp_plan, **{"layers.*.mlp": "moe_tp_experts"})
    monkeypatch.setattr(transformers.LlamaConfig, "base_model_tp_plan", plan)
    with pytest.raises(PlanError, match=r"'model.layers.\*.mlp' \(style 'moe_tp_experts'\).*LlamaMLP has no stacked expert"):
        Plan.from_hf(TP2, build("LlamaConfig", "LlamaForCausalLM"))


def test_moe_identity_expert_is_a_plan_error(monkeypatch):
    plan = dict(transformers.MixtralConfig.base_model_tp_plan, **{"layers.*.mlp.gate": "moe_identity_expert"})
    monkeypatch.setattr(transformers.MixtralConfig, "base_model_tp_plan", plan)
    model = build("MixtralConfig", "MixtralForCausalLM", num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(PlanError, match=r"'model.layers.\*.mlp.gate' \(style 'moe_identity_expert'\).*routed experts"):
        Plan.from_hf(TP2, model)


def test_packed_colwise_splits_a_2d_linear_in_halves():
    spec = style_spec("packed_colwise", module=nn.Linear(16, 2 * 24))
    assert spec == hf(colwise("tp", splits=[24, 24]), "packed_colwise")
    with pytest.raises(PlanError, match="needs the module"):
        style_spec("packed_colwise")


def test_embedding_styles():
    emb = nn.Embedding(32, 16)
    assert style_spec("embedding_rowwise", module=emb) == hf(vocab_parallel("tp"), "embedding_rowwise")
    col = style_spec("embedding_colwise", module=emb)
    assert col.params == {"weight": {"tp": Shard(1)}} and col.out_dst == {"tp": R}  # HF gathers the output
    assert style_spec("all_reduce") == ModuleSpec(out_src={"tp": Partial()}, out_dst={"tp": R}, style="all_reduce")
    assert style_spec("sequence_parallel", axis="mp") == hf(sequence_parallel("mp"), "sequence_parallel")


def test_no_plan_is_a_plan_error():
    model = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                           intermediate_size=64, vocab_size=64))
    with pytest.raises(PlanError, match=r"BertModel \(model_type 'bert'\) ships no tensor-parallel plan.*\['gpt2'\]"):
        Plan.from_hf(TP2, model)


def test_axis_must_be_on_the_mesh(llama):
    with pytest.raises(PlanError, match=r"neither axis 'tp' \(HF's tp plan\) nor 'ep' \(its ep plan\) is on the mesh \{'mp': 2\}"):
        Plan.from_hf(MeshSpec(("mp",), (2,)), llama)
    assert Plan.from_hf(MeshSpec(("dp", "mp"), (2, 2)), llama, axis="mp").specs["lm_head"].out_dst == {"mp": R}


# ----------------------------------------------------------------------------- duck typing


class _Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(16, 16)}) for _ in range(2))


class _Head(nn.Module):
    """An HF-shaped model without transformers: config plan, head plan, base_model_prefix."""
    base_model_prefix = "model"
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(base_model_tp_plan={"layers.*.proj": "colwise"}, model_type="toy")
        self.model = _Base()
        self.lm_head = nn.Linear(16, 32, bias=False)


def test_plan_composed_from_config_and_head_plan():
    # without HF's resolved tp_plan, the merge post_init does: head plan, prefixed base plan, default embed_tokens
    assert hf_tp_plan(_Head()) == {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise",
                                   "model.layers.*.proj": "colwise"}
    assert list(Plan.from_hf(TP2, _Head()).specs) == ["model.embed_tokens", "model.layers.*.proj", "lm_head"]


def test_core_does_not_import_transformers():
    code = "import sys, fxshard, fxshard.plan.importers.hf_plan; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------- every style HF uses


def _config_classes_with_a_plan():
    import transformers.models as models

    for info in pkgutil.iter_modules(models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}.configuration_{info.name}")
        except Exception:  # a family without a config module, or one needing an extra
            continue
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__ and getattr(value, "base_model_tp_plan", None):
                yield value


def _stand_in(style: str) -> nn.Module:
    return nn.Embedding(32, 16) if style.startswith("embedding") else nn.Linear(16, 32)


@pytest.mark.slow
def test_every_style_in_installed_configs_is_mapped_or_refused():
    classes = list(_config_classes_with_a_plan())
    assert len(classes) > 100  # transformers 5.23: 146
    seen = set()
    for cls in classes:
        for pattern, style in cls.base_model_tp_plan.items():
            seen.add(style)
            try:
                spec = style_spec(style, module=_stand_in(style), pattern=pattern)
            except PlanError as e:
                assert "routed experts" in str(e), (cls.__name__, pattern, style, e)  # only MoE is refused here
            else:
                assert isinstance(spec, ModuleSpec) and spec.style == style
    assert {"colwise", "rowwise", "moe_tp_experts", "packed_colwise"} <= seen


def test_every_registered_style_is_known():
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the EP styles)

    registered = set(ALL_PARALLEL_STYLES.keys())
    assert {"colwise", "grouped_gemm"} <= registered <= set(KNOWN_STYLES)


# ----------------------------------------------------------------------------- routed experts (MoE)

EXPERTS = "model.layers.*.mlp.experts"
HF_DIMS = {"gate_up_proj": (1, 2), "down_proj": (2, 1)}


def mixtral():
    return build("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)


def test_mixtral_experts_are_routed_experts_on_tp():
    """HF's moe_tp_experts with packed_colwise gate_up / rowwise down: each expert sharded
    like a SwiGLU MLP; the router (mlp.gate) stays replicated."""
    specs = Plan.from_hf(TP2, mixtral()).specs
    assert specs[EXPERTS] == routed_experts(tp="tp", tp_dims=HF_DIMS)
    assert not any(k.endswith("mlp.gate") for k in specs)


def test_an_ep_mesh_reads_the_ep_plan_only():
    plan = Plan.from_hf(MeshSpec(("ep",), (2,)), mixtral())
    assert plan.specs == {EXPERTS: routed_experts(ep="ep")}


def test_an_ep_tp_mesh_reads_both_plans():
    specs = Plan.from_hf(MeshSpec(("ep", "tp"), (2, 2)), mixtral()).specs
    assert specs[EXPERTS] == routed_experts(ep="ep", tp="tp", tp_dims=HF_DIMS)
    assert specs["model.layers.*.self_attn.q_proj"] == hf(colwise("tp"), "colwise")


def test_ep_mesh_without_an_ep_plan_is_a_plan_error():
    with pytest.raises(PlanError, match=r"axis 'ep'.*LlamaForCausalLM ships no expert-parallel plan.*routed_experts"):
        Plan.from_hf(MeshSpec(("ep",), (2,)), build("LlamaConfig", "LlamaForCausalLM"))
    with pytest.raises(PlanError, match=r"neither axis 'tp'.*nor 'ep'"):
        Plan.from_hf(MeshSpec(("dp",), (2,)), mixtral())


def test_a_packed_gate_up_that_hf_calls_colwise_is_read_packed():
    """Inkling-2's plan names its fused gate | up weight plain colwise: a contiguous split
    would hand one rank all of gate and the other all of up.  Running the experts on their
    shards tells, and the importer takes the packed reading."""
    from fxshard.testing.hf_tiny import tiny_model

    model = tiny_model("inkling2_text")
    assert model.tp_plan["model.layers.*.mlp.experts.gate_up_proj"] == "colwise"
    spec = Plan.from_hf(TP2, model).specs[EXPERTS]
    assert spec == routed_experts(tp="tp", tp_dims=HF_DIMS) and "split gate from up" in spec.style


def test_kv_heads_shared_when_the_axis_is_larger():
    """At tp=4 with 2 KV heads, HF's colwise k/v projections become colwise(heads=2); q and an MLP
    as wide as the KV heads (16 = 2 x 8) keep HF's colwise; at tp=2 nothing changes."""
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**SMALL, "num_attention_heads": 8, "intermediate_size": 16}))
    specs = Plan.from_hf(MeshSpec(("tp",), (4,)), model).specs
    for name in ("k_proj", "v_proj"):
        assert specs[f"model.layers.*.self_attn.{name}"] == replace(colwise("tp"), heads=2)
    assert specs["model.layers.*.self_attn.q_proj"].heads is None
    assert specs["model.layers.*.mlp.gate_proj"].heads is None
    assert all(getattr(s, "heads", None) is None for s in Plan.from_hf(TP2, model).specs.values())


def per_layer_gemma4(seed: int = 0, heads: int = 4, kv_heads: int = 2, layer1_kv_heads: int = 1, head_dim: int = 16):
    """Tiny Gemma 4 whose global-attention layer (1) has fewer KV heads than the sliding
    one (0): ``num_key_value_heads`` is a per-layer attribute (transformers' heterogeneous configs)."""
    from fxshard.testing.hf_tiny import config_class, tiny_kwargs

    cls = config_class("gemma4_text")
    kw = {**tiny_kwargs(cls, "gemma4_text"), "num_attention_heads": heads, "num_key_value_heads": kv_heads,
          "head_dim": head_dim, "per_layer_config": {1: {"num_key_value_heads": layer1_kv_heads}}}
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float32).train()


def per_layer_gemma4_cut():
    """8 heads of 8; 4 KV heads on layer 0, 2 on layer 1: tp=2 cuts both."""
    return per_layer_gemma4(heads=8, kv_heads=4, layer1_kv_heads=2, head_dim=8)


def per_layer_gemma4_plan(mesh):
    return Plan.from_hf(mesh, per_layer_gemma4_cut())


def _logits(out):
    return out.logits


def _loss(out):
    return out.loss


def test_per_layer_config_model_on_gloo():
    """tp=2, real gloo: the plan Plan.from_hf reads from a config with per-layer KV heads
    is exact (logits, loss, every gradient, and logits after an SGD step; labels distinct
    with -100 padding).
    Tolerance 5e-5 after the step: step 0 holds at 1e-5, then Gemma's softcapped logits
    drift by float reordering."""
    from equivalence import Case, check_real_cases
    from fxshard.testing.hf_tiny import tiny_inputs

    ids, labels = tiny_inputs(2, 8, 128, seed=0)
    check_real_cases(2, [Case(per_layer_gemma4_cut, per_layer_gemma4_plan, (), {"tp": 2}, kwargs={"input_ids": ids, "labels": labels},
                              select=_logits, loss_fn=_loss, replicated_loss=True, atol=5e-5, rtol=1e-4, steps=1,
                              name="gemma4 per-layer kv heads")])


def test_per_layer_kv_heads_read_from_each_layer():
    """Reading config.num_key_value_heads on such a config raises transformers'
    AmbiguousGlobalPerLayerAttributeError; the importer reads each layer's own value and
    splits the k/v patterns by layer: layer 1's single KV head is shared (heads=1) at tp=2,
    layer 0's two are cut."""
    model = per_layer_gemma4()
    config = model.config
    assert config.is_heterogeneous and [config.per_layer_config[i].num_key_value_heads for i in (0, 1)] == [2, 1]
    specs = Plan.from_hf(TP2, model).specs
    for name in ("k_proj", "v_proj"):
        assert f"model.layers.*.self_attn.{name}" not in specs
        assert specs[f"model.layers.0.self_attn.{name}"].heads is None
        assert specs[f"model.layers.1.self_attn.{name}"] == replace(specs[f"model.layers.0.self_attn.{name}"], heads=1)
    assert specs["model.layers.*.self_attn.q_proj"].heads is None
    # at tp=4 both layers share their KV heads, each with its own count
    specs4 = Plan.from_hf(MeshSpec(("tp",), (4,)), model).specs
    assert specs4["model.layers.0.self_attn.k_proj"].heads == 2 and specs4["model.layers.1.self_attn.k_proj"].heads == 1


def test_per_layer_attribute_outside_a_layer_is_a_plan_error():
    """A KV projection fxshard cannot place in a decoder layer has no layer to read from."""
    model = per_layer_gemma4()
    attention = type(model.model.layers[1].self_attn)
    stray = attention.__new__(attention)  # an attention module outside the layer list
    nn.Module.__init__(stray)
    stray.k_proj = nn.Linear(64, 16, bias=False)
    model.model.extra = nn.ModuleDict({"self_attn": stray})
    model.tp_plan["model.extra.self_attn.k_proj"] = "colwise"
    with pytest.raises(PlanError, match=r"config.num_key_value_heads varies per layer.*'model.extra.self_attn.k_proj'.*heads="):
        Plan.from_hf(TP2, model)
