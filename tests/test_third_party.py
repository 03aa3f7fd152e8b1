"""Third-party conformance: model code this project did not write (litgpt's ``GPT`` from
its own configs, torchtune's component builders with torchtune's own TP plan through
``Plan.from_torch``, transformers' encoders, encoder-decoders and vision transformers
through ``auto_plan``), each transformed at tp=2 and equal to one device: the loss,
the output, every parameter gradient (each rank's shard against the matching slice)
and the output after 2 SGD steps, with example inputs that are other tensors than the
run inputs (labels distinct from the ids, -100 padded).  A case fxshard refuses by
design raises the PlanError its case names (:mod:`fxshard.conformance.third_party`).

Simulated ranks for the breadth; one real-gloo spawn over one case per library."""
import pytest
import torch

import fxshard
from equivalence import Case, check_real_cases, check_simulated
from fxshard.conformance import third_party
from fxshard.meta import program_meta

CASES = {c.name: c for c in third_party.all_cases()}  # nothing imported yet: collection stays cheap on every worker
KNOWN = list(CASES)

# The suite runs one case per library and kind (quick), a wider set of distinct architectures (slow, still
# run in CI) and three more on real gloo ranks: 14 of the sweep's cases, ~7 s of CPU each (an auto_plan
# transforms several variants).  ``python benchmarks/third_party.py`` runs every case (the README table).
QUICK = ["litgpt/Llama-3.2", "torchtune/llama3", "transformers/BERT", "transformers/T5", "transformers/ViT"]
WIDE = ["litgpt/Phi-2 (parallel residual)", "litgpt/Falcon (multi-query, shared norm)",
        "litgpt/Gemma-3 (sliding window, q/k norm)", "torchtune/gemma2 (softcapping, sliding)",
        "torchtune/llama3.2 (tied embedding), whole plan", "transformers/DeBERTa-v2", "litgpt/Mixtral (MoE)"]
REAL = ["litgpt/pythia (GPT-NeoX)", "torchtune/qwen2 (q/k/v bias)", "transformers/BART"]


def _case(name):
    case = CASES[name]
    if not third_party.library_available(case.library):
        pytest.skip(f"{case.library} does not import here (install the 'thirdparty' extra and litgpt, see .ci/run)")
    return case


def _check(case):
    kw = case.check_kwargs()
    inputs = kw.pop("inputs")
    if case.refusal:
        with pytest.raises(fxshard.PlanError, match=case.refusal) as info:
            check_simulated(case.build, case.plan, inputs, {"tp": 2}, **kw)
        assert "internal error" not in str(info.value)
        return
    sharded = check_simulated(case.build, case.plan, inputs, {"tp": 2}, **kw)
    state = program_meta(sharded).state
    sharded_params = [fqn for fqn, (layout, _) in state.items()
                      if any(isinstance(p, torch.distributed.tensor.Shard) for p in (layout or {}).values())]
    assert sharded_params, f"{case.name}: the plan shards no parameter; the check proves nothing"


@pytest.mark.parametrize("name", QUICK)
def test_third_party_quick(name):
    _check(_case(name))


@pytest.mark.slow
@pytest.mark.sweep  # every case of every library: .ci/run's second stage (the quick cases above stay)
@pytest.mark.parametrize("name", WIDE)
def test_third_party_sweep(name):
    _check(_case(name))


def test_third_party_real_gloo():
    """One case per library on 2 real gloo ranks (the plan made on each rank)."""
    cases = []
    for name in REAL:
        c = _case(name)
        kw = c.check_kwargs()
        cases.append(Case(c.build, c.plan, kw.pop("inputs"), {"tp": 2}, **kw))
    check_real_cases(2, cases)


def test_sweep_lists():
    """The suite's cases are cases of the sweep, each once; a refusal carries the reason the README prints."""
    chosen = QUICK + WIDE + REAL
    assert len(set(chosen)) == len(chosen) and set(chosen) <= set(KNOWN), sorted(set(chosen) - set(KNOWN))
    for c in third_party.all_cases():
        assert not c.refusal or len(c.why) > 40, c.name


def litgpt_gqa_plan(mesh, splits=(64, 32, 32)):
    """litgpt's Llama under GQA (4 query heads, 2 KV groups of 16): its own fused ``qkv`` is
    ``[q | k | v]`` of 64, 32 and 32 rows, split by ``torch.split``; sharded part by part."""
    specs = {"transformer.h.*.attn.qkv": fxshard.colwise("tp", splits=list(splits) if splits else None),
             "transformer.h.*.attn.proj": fxshard.rowwise("tp"),
             "transformer.h.*.mlp.fc_1": fxshard.colwise("tp"), "transformer.h.*.mlp.fc_2": fxshard.colwise("tp"),
             "transformer.h.*.mlp.proj": fxshard.rowwise("tp")}
    return fxshard.Plan(mesh, specs)


def test_litgpt_llama_gqa_fused_qkv_part_by_part():
    """Unequal parts of a fused projection shard part by part, as equal ones do: exact at tp=2 on
    simulated ranks and on real gloo (logits, every gradient, 2 SGD steps); a plain colwise on the
    fused weight is refused at its torch.split, naming the parts."""
    case = _case("litgpt/Llama-3.2")
    model = case.build()
    assert (model.config.n_head, model.config.n_query_groups) == (4, 2)
    kw = case.check_kwargs()
    inputs = kw.pop("inputs")
    check_simulated(case.build, litgpt_gqa_plan, inputs, {"tp": 2}, **kw)
    check_real_cases(2, [Case(case.build, litgpt_gqa_plan, inputs, {"tp": 2}, **kw)])
    with pytest.raises(fxshard.PlanError, match=r"(?s)torch.split.*into pieces \[64, 32, 32\].*"
                                                r"colwise\('tp', splits=\[64, 32, 32\]\)"):
        fxshard.transform(model, litgpt_gqa_plan(fxshard.MeshSpec(("tp",), (2,)), splits=None), kw["example_inputs"])
