"""Model code fxshard did not write, for the third-party conformance sweep.

Each :class:`ThirdPartyCase` is one model from a library installed from PyPI next to
torch (the ``thirdparty`` and ``hf`` extras), built with tiny random weights from the
library's own config class or builder, with the plan its library ships (torchtune's
``base_llama_tp_plan`` through :meth:`Plan.from_torch`) or the one
:func:`fxshard.auto_plan` finds (libraries that ship none: litgpt, transformers'
encoders, encoder-decoders and vision transformers)::

    from fxshard.conformance.third_party import cases

    for case in cases():                      # those whose library imports here
        model = case.build()                  # tiny, float32, seeded
        args, kwargs, targets = case.batch()  # distinct tensors, labels padded with -100
        plan = case.plan(mesh)                # the library's plan, or auto_plan's
        sharded = fxshard.transform(model, plan, example_inputs=args, example_kwargs=kwargs)

``tests/test_third_party.py`` checks every case against one device (loss, outputs,
every gradient, 2 SGD steps) and ``benchmarks/third_party.py`` prints the table.
Libraries tried and left out (they do not import next to torch 2.13 CPU) are in
:data:`NOT_INSTALLABLE`.  Every factory here is a top-level function or a
``functools.partial`` of one, so cases pickle into real gloo ranks.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ThirdPartyCase", "all_cases", "cases", "case", "NOT_INSTALLABLE", "VOCAB", "token_cross_entropy", "logits_of",
           "loss_of", "library_available"]

VOCAB = 128
BATCH, SEQ = 2, 8
IMAGE, PATCH, CLASSES = 32, 8, 10

# library -> why the sweep cannot use it (checked by hand on torch 2.13.0+cpu)
NOT_INSTALLABLE = {
    "timm": "imports torchvision at import time (timm.layers); torchvision's PyPI wheel for torch 2.13 (0.28.0) is a "
            "CUDA build that needs libtorch_cuda ('operator torchvision::nms does not exist' on the CPU torch), and "
            "the CPU build is not on PyPI: a working torchvision would move torch to the CUDA build",
    "torchtune CLIP / Llama-3.2-Vision": "torchtune.models.clip imports torchvision (same reason as timm)",
    "OLMo-core (ai2-olmo-core 3.0.0: Llama, OLMo-2)": "installs next to torch 2.13 with --no-deps, but importing "
            "olmo_core.nn.transformer needs cached-path, whose import needs google-cloud-storage and boto3 (and "
            "bettermap, dataclass-extensions); with those stubbed, both capture, also a second time, since the capture "
            "leaves the model's caches as it found them (its rotary tables, filled on the first call, are reproduced by "
            "tests/frontend/test_capture_help.py's CachedRotaryLM)",
}


# ----------------------------------------------------------------------------- losses (top level: they pickle)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token loss as litgpt and torchtune compute it outside the model: cross
    entropy over ``[B, S, V]`` logits against ``[B, S]`` labels, -100 ignored."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)


def logits_of(out) -> torch.Tensor:
    """The compared tensor of a transformers output (``out.logits``)."""
    return out.logits


def loss_of(out) -> torch.Tensor:
    """The loss a transformers model computes itself from ``labels=``."""
    return out.loss


# ----------------------------------------------------------------------------- the case


@dataclasses.dataclass(frozen=True)
class ThirdPartyCase:
    """One third-party model with its plan and inputs.

    ``kind``: ``"lm"`` (token ids in, logits out; loss :func:`token_cross_entropy`
    against shifted labels outside the model, as the library's recipes do), ``"hf"``
    (keyword ``input_ids``/``labels``, the model's own ``.loss``, ``.logits`` compared)
    or ``"hf-vision"`` (``pixel_values``/``labels``).  ``refusal``: a regex the
    PlanError must match when fxshard refuses the case by design, ``why`` the reason
    (the README table's text).
    """

    library: str
    model: str
    plan_source: str
    kind: str
    build: Callable[[], nn.Module]
    plan: Callable[[Any], Any]
    refusal: str | None = None
    why: str = ""
    extra_inputs: tuple = ()  # names of other keyword inputs ("attention_mask")
    tolerance: float = 1e-5  # atol and rtol in float32; above 1e-5 only where float64 agrees to 1e-9 (see FLOAT32_NOISE)
    dtype: torch.dtype = torch.float32

    @property
    def name(self) -> str:
        """``library/model``: unique in the sweep."""
        return f"{self.library}/{self.model}"

    def batch(self, seed: int = 0) -> tuple[tuple, dict, tuple]:
        """``(args, kwargs, targets)`` for one step: distinct tensors, labels other
        tokens than the inputs with -100 on the prompt and at random."""
        args, kwargs, targets = _batch(self.kind, self.extra_inputs, seed)
        if self.dtype != torch.float32:
            kwargs = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in kwargs.items()}
        return args, kwargs, targets

    def check_kwargs(self, seed: int = 0) -> dict:
        """The keywords of ``tests/equivalence.py``'s ``check_simulated`` / ``Case`` for this
        case: inputs, the loss (the model's own, or :func:`token_cross_entropy` outside it)
        and the compared output."""
        args, kwargs, targets = self.batch(seed)
        example_args, example_kwargs = self.example()
        tol = self.tolerance if self.dtype == torch.float32 else 1e-9
        common = dict(inputs=args, kwargs=kwargs, example_inputs=example_args, example_kwargs=example_kwargs or None,
                      lr=0.2, name=self.name, atol=tol, rtol=tol)
        if self.kind == "lm":
            return dict(common, loss_fn=token_cross_entropy, targets=targets)
        return dict(common, select=logits_of, loss_fn=loss_of, replicated_loss=True)

    def example(self) -> tuple[tuple, dict]:
        """The inputs ``auto_plan`` and ``transform`` see (another batch of the same shapes)."""
        args, kwargs, _ = self.batch(seed=1)
        return args, kwargs

    def in_float64(self) -> "ThirdPartyCase":
        """The same case in float64 (model, plan's model, float inputs), checked at 1e-9: a
        float32 difference that vanishes here is summation order, not a wrong number."""
        build = functools.partial(_double, self.build)
        plan = self.plan
        if isinstance(plan, functools.partial) and "build" in plan.keywords:
            plan = functools.partial(plan.func, *plan.args, **{**plan.keywords, "build": build, "dtype": torch.float64})
        return dataclasses.replace(self, build=build, plan=plan, dtype=torch.float64)


def _double(build: Callable[[], nn.Module]) -> nn.Module:
    return build().double()


def _batch(kind: str, extra: tuple, seed: int):
    from fxshard.testing.hf_tiny import tiny_inputs

    if kind == "hf-vision":
        g = torch.Generator().manual_seed(100 + seed)
        pixels = torch.randn(4, 3, IMAGE, IMAGE, generator=g)
        labels = torch.randint(0, CLASSES, (4,), generator=g)
        labels[1] = -100
        return (), {"pixel_values": pixels, "labels": labels}, ()
    ids, labels = tiny_inputs(BATCH, SEQ, VOCAB, seed=seed)
    if kind == "lm":  # the model sees tokens; the loss outside it scores the next token
        return (ids,), {}, (labels,)
    kwargs = {"input_ids": ids}
    if "attention_mask" in extra:  # one padded row, as a real batch has
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        kwargs["attention_mask"] = mask
    kwargs["labels"] = labels
    return (), kwargs, ()


# ----------------------------------------------------------------------------- plans


def auto_plan_for(mesh, build: Callable[[], nn.Module], kind: str, extra: tuple = (), dtype=torch.float32):
    """``auto_plan`` on the model ``build`` makes, with the case's example inputs."""
    from fxshard.planner.auto_plan import auto_plan
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():  # under simulated ranks: a plain model, as each real rank builds it
        model = build()
        args, kwargs, _ = _batch(kind, extra, seed=1)
        kwargs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kwargs.items()}
    return auto_plan(model, mesh, example_inputs=args, example_kwargs=kwargs or None)


def torchtune_llama_plan(mesh, drop: tuple = ()):
    """torchtune's own tensor-parallel plan (``base_llama_tp_plan``, what its recipes pass
    to ``parallelize_module``), converted by ``Plan.from_torch``; ``drop``: entries
    left out (``"output"`` for a model whose head is a ``TiedLinear``, not a module: torch's
    ``parallelize_module`` skips the entry with a warning, fxshard refuses it)."""
    from torchtune.models.llama3 import base_llama_tp_plan

    from fxshard.plan.plan import Plan

    return Plan.from_torch(mesh, {k: v for k, v in base_llama_tp_plan().items() if k not in drop})


# ----------------------------------------------------------------------------- litgpt


LITGPT_TINY = dict(n_layer=2, n_embd=64, n_head=4, head_size=16, intermediate_size=128, vocab_size=VOCAB,
                   padded_vocab_size=VOCAB, block_size=64)


def litgpt_model(name: str, **overrides) -> nn.Module:
    """litgpt's ``GPT`` from ``Config.from_name(name)`` at tiny size (its own config class)."""
    from litgpt.config import Config
    from litgpt.model import GPT

    cfg = Config.from_name(name, **{**LITGPT_TINY, **overrides})
    torch.manual_seed(0)
    return GPT(cfg).float().train()


# name, litgpt config, overrides: one per architecture the config zoo has
LITGPT = [
    ("pythia (GPT-NeoX)", "pythia-14m", dict(n_query_groups=4)),
    ("Llama-3.2", "Llama-3.2-1B", dict(n_query_groups=2)),
    ("Qwen2.5", "Qwen2.5-0.5B", dict(n_query_groups=2)),
    ("Qwen3 (q/k norm)", "Qwen3-0.6B", dict(n_query_groups=2)),
    ("Phi-2 (parallel residual)", "phi-2", dict(n_query_groups=4)),
    ("Gemma (GeGLU, scaled embedding)", "gemma-2b", dict(n_query_groups=2)),
    ("Gemma-3 (sliding window, q/k norm)", "gemma-3-1b-it", dict(n_query_groups=2, sliding_window_size=4)),
    ("Falcon (multi-query, shared norm)", "falcon-7b", dict(n_query_groups=1)),
    ("OLMo (LayerNorm, no bias)", "OLMo-1B-hf", dict(n_query_groups=4)),
    ("Mistral", "Mistral-7B-v0.1", dict(n_query_groups=2)),
    ("Mixtral (MoE)", "Mixtral-8x7B-v0.1", dict(n_query_groups=2, n_expert=4, n_expert_per_token=2,
                                                moe_intermediate_size=32)),
]

LITGPT_REFUSALS = {
    "Mixtral (MoE)": (r"(?s)cannot shard node `where`.*LLaMAMoE.*depends on the values of its input",
                      "its expert loop indexes tokens with `torch.where(mask)`, a shape that depends on the routing: "
                      "fxshard lays shapes out before the run; the error names the line and says to make the MoE "
                      "block an opaque region (fxshard.expert_parallel)"),
}


# ----------------------------------------------------------------------------- torchtune


TUNE_TINY = dict(vocab_size=VOCAB, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, max_seq_len=64)


def torchtune_model(builder: str, **kw) -> nn.Module:
    """A torchtune component builder (``torchtune.models.<family>.<family>(...)``) at tiny size."""
    module, fn = builder.rsplit(".", 1)
    build = getattr(importlib.import_module(module), fn)
    torch.manual_seed(0)
    return build(**{**TUNE_TINY, **kw}).float().train()


TIED_PAIR = ("tok_embeddings", "output")
TORCHTUNE_TIED = {"llama3.2 (tied embedding)", "gemma (tied, GeGLU)", "gemma2 (softcapping, sliding)"}
TORCHTUNE = [
    ("llama3", "torchtune.models.llama3.llama3", dict(intermediate_dim=128)),
    ("llama2", "torchtune.models.llama2.llama2", dict(intermediate_dim=128)),
    ("llama3.2 (tied embedding)", "torchtune.models.llama3_2.llama3_2", dict(intermediate_dim=128)),
    ("qwen2 (q/k/v bias)", "torchtune.models.qwen2.qwen2", dict(intermediate_dim=128)),
    ("mistral", "torchtune.models.mistral.mistral", dict(intermediate_dim=128)),
    ("phi3", "torchtune.models.phi3.phi3", dict(intermediate_dim=128)),
    ("gemma (tied, GeGLU)", "torchtune.models.gemma.gemma", dict(intermediate_dim=128, head_dim=16)),
    ("gemma2 (softcapping, sliding)", "torchtune.models.gemma2.gemma2", dict(intermediate_dim=128, head_dim=16,
                                                                              sliding_window_size=4)),
]


# ----------------------------------------------------------------------------- transformers


def hf_model(auto: str, model_type: str, **config) -> nn.Module:
    """``transformers.<auto>.from_config(<model_type> config(**config))`` (``auto`` an Auto class
    or a model class) in float32, train mode, dropouts 0."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **config)
    for k, v in list(vars(cfg).items()):
        if isinstance(v, float) and ("dropout" in k or k.endswith("pdrop") or k.endswith("_prob")) and "layer_norm" not in k:
            setattr(cfg, k, 0.0)
    torch.manual_seed(0)
    cls = getattr(transformers, auto)
    model = cls.from_config(cfg, dtype=torch.float32) if auto.startswith("Auto") else cls(cfg)
    return model.float().train()


_ENC = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, pad_token_id=0)
_ENCDEC = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
               decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, use_cache=False)
_T5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
           relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, use_cache=False)
_VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=IMAGE,
            patch_size=PATCH, num_labels=CLASSES)

# name, Auto class, model_type, config, kind, extra inputs
HF = [
    ("BERT", "AutoModelForMaskedLM", "bert", _ENC, "hf", ("attention_mask",)),
    ("RoBERTa", "AutoModelForMaskedLM", "roberta", {**_ENC, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
                                                    "max_position_embeddings": 66}, "hf", ()),
    ("DistilBERT", "AutoModelForMaskedLM", "distilbert", dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4,
                                                              hidden_dim=128, max_position_embeddings=64, pad_token_id=0),
     "hf", ("attention_mask",)),
    ("ALBERT (shared layers)", "AutoModelForMaskedLM", "albert", {**_ENC, "embedding_size": 32}, "hf", ()),
    ("ELECTRA", "AutoModelForMaskedLM", "electra", {**_ENC, "embedding_size": 64}, "hf", ()),
    ("DeBERTa-v2", "AutoModelForMaskedLM", "deberta-v2", {**_ENC, "relative_attention": True, "position_buckets": 8,
                                                           "pos_att_type": ["p2c", "c2p"]}, "hf", ()),
    ("MPNet", "AutoModelForMaskedLM", "mpnet", {**_ENC, "pad_token_id": 1, "max_position_embeddings": 66}, "hf", ()),
    ("T5", "AutoModelForSeq2SeqLM", "t5", _T5, "hf", ()),
    ("BART", "AutoModelForSeq2SeqLM", "bart", _ENCDEC, "hf", ()),
    ("mBART", "AutoModelForSeq2SeqLM", "mbart", _ENCDEC, "hf", ("attention_mask",)),
    ("Pegasus", "AutoModelForSeq2SeqLM", "pegasus", _ENCDEC, "hf", ()),
    ("Marian", "AutoModelForSeq2SeqLM", "marian", {**_ENCDEC, "decoder_start_token_id": 0}, "hf", ()),
    ("ViT", "AutoModelForImageClassification", "vit", _VIT, "hf-vision", ()),
    ("DeiT", "DeiTForImageClassification", "deit", _VIT, "hf-vision", ()),
    ("Dinov2", "AutoModelForImageClassification", "dinov2", _VIT, "hf-vision", ()),
]


# ----------------------------------------------------------------------------- the list

# Cases whose float32 results differ from one device by more than 1e-5 and whose float64 runs agree to 1e-9
# (``python benchmarks/third_party.py --float64``): the sharded program sums in another order.
#   DeiT: the position-embedding gradient sums [B, 66, 64] over the batch, values ~64 (2.7e-5 relative);
#   tied torchtune heads: the embedding's gradient adds the head's and the lookup's, amplified by 2 SGD steps at lr 0.2.
FLOAT32_NOISE = {
    "transformers/DeiT": 1e-4,
    "torchtune/llama3.2 (tied embedding)": 1e-4,
    "torchtune/gemma (tied, GeGLU)": 1e-4,
    "torchtune/gemma2 (softcapping, sliding)": 1e-4,
}


def library_available(library: str) -> bool:
    """Does ``library`` import here (litgpt, torchtune, transformers)?"""
    try:
        importlib.import_module({"litgpt": "litgpt.model", "torchtune": "torchtune.models.llama3"}.get(library, library))
        return True
    except Exception:  # noqa: BLE001 - any failure to import means: not available
        return False


def all_cases() -> list[ThirdPartyCase]:
    """Every case of the sweep, whether its library imports here or not (building one needs it)."""
    out = []
    for model, name, over in LITGPT:
        build = functools.partial(litgpt_model, name, **over)
        refusal, why = LITGPT_REFUSALS.get(model, (None, ""))
        out.append(ThirdPartyCase("litgpt", model, "auto_plan", "lm", build,
                                  functools.partial(auto_plan_for, build=build, kind="lm"), refusal=refusal, why=why))
    for model, builder, kw in TORCHTUNE:
        build = functools.partial(torchtune_model, builder, **kw)
        tied = model in TORCHTUNE_TIED
        # a tied head (TiedLinear) reads the embedding's weight: with the embedding vocab-sharded and no module to
        # gather at, the logits stay vocab-sharded; the blocks are sharded, the tied pair replicated
        out.append(ThirdPartyCase("torchtune", model, "base_llama_tp_plan" + (" less the tied pair" if tied else "")
                                  + " (Plan.from_torch)", "lm", build,
                                  functools.partial(torchtune_llama_plan, drop=TIED_PAIR if tied else ())))
    for model, builder, kw in TORCHTUNE[2:3]:  # the whole plan on a tied head: refused, naming the entry
        build = functools.partial(torchtune_model, builder, **kw)
        out.append(ThirdPartyCase("torchtune", f"{model}, whole plan", "base_llama_tp_plan (Plan.from_torch)", "lm", build,
                                  torchtune_llama_plan, refusal=r"plan entry 'output' matches no module",
                                  why="the head is a TiedLinear (a plain callable, not a module): the plan's 'output' "
                                      "entry names nothing; torch skips it with a warning, fxshard names it"))
    for model, builder, kw in TORCHTUNE[:1]:
        build = functools.partial(torchtune_model, builder, **kw)
        out.append(ThirdPartyCase("torchtune", f"{model}, auto_plan", "auto_plan", "lm", build,
                                  functools.partial(auto_plan_for, build=build, kind="lm")))
    for model, auto, model_type, cfg, kind, extra in HF:
        build = functools.partial(hf_model, auto, model_type, **cfg)
        out.append(ThirdPartyCase("transformers", model, "auto_plan", kind, build,
                                  functools.partial(auto_plan_for, build=build, kind=kind, extra=extra),
                                  extra_inputs=extra))
    out = [dataclasses.replace(c, tolerance=FLOAT32_NOISE[c.name]) if c.name in FLOAT32_NOISE else c for c in out]
    assert len({c.name for c in out}) == len(out), "case names must be unique"
    return out


def cases(libraries: tuple[str, ...] | None = None) -> list[ThirdPartyCase]:
    """The sweep's cases whose library imports here (all of them, or those of ``libraries``)."""
    ok = {lib: library_available(lib) for lib in ("litgpt", "torchtune", "transformers")}
    return [c for c in all_cases() if ok[c.library] and (libraries is None or c.library in libraries)]


def case(name: str) -> ThirdPartyCase:
    """The case called ``name`` (``"litgpt/pythia (GPT-NeoX)"``)."""
    for c in all_cases():
        if c.name == name:
            return c
    raise KeyError(f"no third-party case {name!r}; known: {[c.name for c in all_cases()]}")
