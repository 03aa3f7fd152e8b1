"""Tiny transformers decoders for tests and benchmarks (needs ``transformers``; CPU, no downloads).

:func:`decoder_families` lists the decoder families of the installed transformers that
ship a tensor-parallel plan (their config class has a non-empty ``base_model_tp_plan``)
and have a ``*ForCausalLM`` class; :func:`tiny_config` builds a tiny config for any of
them generically; :func:`tiny_model` builds the model from it, in float32, with a fixed
seed::

    from fxshard.testing.hf_tiny import decoder_families, tiny_inputs, tiny_model

    for family in decoder_families():           # ["afmoe", "apertus", ..., "llama", ...]
        model = tiny_model(family)              # AutoModelForCausalLM.from_config(tiny_config(family))
        ids, labels = tiny_inputs()             # labels: other tokens, -100 on the prompt
        out = model(input_ids=ids, labels=labels)  # out.logits [2, 8, 128], out.loss

The sizes (:data:`TINY`): hidden 64, 2 layers (up to 4 where layers differ, below), 4 heads, 2 kv heads, head_dim 16,
intermediate 128, vocab 128, max positions 64; every dropout and jitter 0,
``use_cache=False``, router logits not returned (the loss is the cross-entropy alone).
MoE fields are small when the config has them: 4 experts, top-2, expert width 32, one
shared expert, one expert group; MLA ranks 32 with rope/nope head dims 8 + 8 (``head_dim`` the rope
part, kv heads = heads); indexers (sparse attention) of top-64, i.e. dense at test lengths; sliding
and chunked windows 4 (shorter than a test's sequence, so that the window matters).
Special token ids that the default config sets are moved inside the vocabulary
(pad 0, bos 1, eos 2, others from the top of the vocabulary down).

Only fields the config class has are set (its dataclass fields, or a name its
``attribute_map`` redirects to one), under whichever name the family uses
(:data:`ALIASES`: ``n_embd``/``n_layer``/``n_head``, ``num_local_experts``,
``n_routed_experts``, ``moe_topk`` ...).

Per-layer lists (``layer_types``, ``mlp_layer_types``, ``no_rope_layers``, Gemma-3n's
per-layer ``intermediate_size`` ...: any list field as long as the default config's
layer count) are resampled: the tiny model keeps one layer of each distinct
combination of per-layer values, in the order they first occur (a sliding and a full
attention layer, a dense and a sparse MLP), at least 2 and at most
:data:`MAX_LAYERS` layers; the layer count follows.  Lists of layer indices
(``moe_layers``, ``mlp_only_layers``) are renumbered to the layers kept.  A scalar size
meant for a field that is a per-layer list is repeated per layer.

Families whose generic tiny config needs more are listed in :data:`FAMILY_OVERRIDES`
(the table in its comment says why).  A family whose model cannot be built at tiny size
raises :class:`TinyBuildError` saying why (:func:`build_report` collects them all).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["TINY", "ALIASES", "FAMILY_OVERRIDES", "MAX_LAYERS", "TinyBuildError", "decoder_families", "tiny_config",
           "tiny_model", "tiny_inputs", "build_report", "IGNORE_INDEX"]

VOCAB = 128
MAX_LAYERS = 4

# canonical name -> tiny value
TINY: dict[str, Any] = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
    # MoE
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
    n_shared_experts=1, n_group=1, topk_group=1,
    # MLA (DeepSeek-V2/V3 style attention)
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=16,
    # sparse attention indexers (DeepSeek-V3.2 style)
    index_head_dim=16, index_n_heads=2, index_topk=64,
    # linear attention (gated delta net, lightning, KDA)
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_num_heads=4, linear_head_dim=16,
    # mamba: heads * head_dim = expand * hidden
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, mamba_n_groups=1,
    # windows
    sliding_window=4, attention_chunk_size=4,
    # attention variants of single families
    swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
    hidden_size_per_layer_input=16, vocab_size_per_layer_input=VOCAB,
    pretraining_tp=1, original_max_position_embeddings=64,
    # DeepSeek-V4's grouped low-rank output projection
    o_lora_rank=32, o_groups=2,
)

# canonical name -> the other names families use for it (the first that is a field of the config class is set)
ALIASES: dict[str, tuple[str, ...]] = dict(
    hidden_size=("n_embd", "d_model", "dim"),
    num_hidden_layers=("n_layer", "num_layers", "n_layers"),
    num_attention_heads=("n_head", "n_heads"),
    num_key_value_heads=("n_kv_heads", "num_kv_heads", "multi_query_group_num"),
    intermediate_size=("n_inner", "ffn_hidden_size", "ffn_dim"),
    max_position_embeddings=("n_positions", "max_seq_len", "seq_length"),
    num_experts=("num_local_experts", "n_routed_experts", "moe_num_experts"),
    num_experts_per_tok=("moe_topk", "moe_k", "num_experts_per_token"),
    moe_intermediate_size=("expert_ffn_hidden_size", "expert_intermediate_size"),
    shared_expert_intermediate_size=("moe_shared_expert_intermediate_size", "shared_intermediate_size",
                                     "shared_experts_intermediate_size"),
    n_shared_experts=("num_shared_experts", "moe_num_shared_experts"),
    n_group=("num_expert_group",),
    mamba_num_heads=("mamba_n_heads",),
    mamba_head_dim=("mamba_d_head",),
    ssm_state_size=("mamba_d_state",),
    mamba_n_groups=("n_groups",),
    sliding_window=("sliding_window_size",),
)

# set only when the default config sets them (a None turns a feature off)
ONLY_IF_SET = {"q_lora_rank", "sliding_window", "attention_chunk_size", "shared_expert_intermediate_size",
               "hidden_size_per_layer_input"}

# zeroed wherever they occur (training-time randomness)
ZERO_SUFFIXES = ("dropout", "pdrop", "jitter_noise", "dropout_rate", "dropout_prob")

# Per-family fixes of the generic config (applied after it, before the caller's overrides;
# names a config's ``__post_init__`` takes as keywords are allowed here).
#
# family               override                                      why
# -------------------  --------------------------------------------  ---------------------------------------------------
# cohere_compass_text  rope_parameters={"full_attention": default}   the default config has rope_parameters {} and the
#                                                                    model looks up rope_parameters[layer_type]
# dots3_note_text      swa_* (heads, MLA ranks and dims) tiny,        its sliding layers take their sizes from swa_*
#                      num_key_value_heads=4                         keywords; MLA needs kv heads == heads
# gemma3n_text         num_kv_shared_layers=0                        15 KV-sharing layers by default; 2 layers share none
# gemma4_text,         global_head_dim=16                            full-attention layers default to head_dim 512
# gemma4_unified_text                                                (a per-layer override)
# longcat_flash        zero_expert_num=2                             256 identity ("zero") experts by default
# lfm2_moe             layer_types=["conv", "full_attention"]        the default config has layer_types None and the
#                                                                    model indexes it
# qwen4_exp_text       indexer_* (QSA) set                           the default layer_types include QSA layers but the
#                                                                    default indexer fields are None
_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "cohere_compass_text": dict(rope_parameters={"full_attention": dict(_DEFAULT_ROPE)}),
    "dots3_note_text": dict(num_key_value_heads=4, swa_num_attention_heads=4, swa_num_key_value_heads=4,
                            swa_q_lora_rank=32, swa_kv_lora_rank=32, swa_head_dim=16, swa_qk_nope_head_dim=8,
                            swa_v_head_dim=16),
    "gemma3n_text": dict(num_kv_shared_layers=0),
    "gemma4_text": dict(global_head_dim=16),
    "gemma4_unified_text": dict(global_head_dim=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "longcat_flash": dict(zero_expert_num=2),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
}


class TinyBuildError(RuntimeError):
    """A family whose tiny config or model cannot be built; the message says why."""


# ----------------------------------------------------------------------------- families


def decoder_families() -> list[str]:
    """``model_type`` of every family with a non-empty ``base_model_tp_plan`` on its config
    class and a ``*ForCausalLM`` class (transformers' auto mappings), sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if model_type not in CONFIG_MAPPING_NAMES or not str(cls_name).endswith("ForCausalLM"):
            continue
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 - a family whose config does not import is not listed
            continue
        if getattr(config_cls, "base_model_tp_plan", None):
            out.append(model_type)
    return sorted(out)


def config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


# ----------------------------------------------------------------------------- configs


def tiny_config(model_type: str, **overrides):
    """A tiny config of family ``model_type`` (module docstring: sizes and rules);
    ``overrides`` (field names of the config class, or names its ``attribute_map``
    knows) are applied last.  ``num_hidden_layers=n`` also sizes the per-layer lists
    (``layer_types`` repeated, ``moe_layers`` renumbered) unless they are given too.

    Example::

        cfg = tiny_config("qwen3_next")
        cfg.layer_types           # ['linear_attention', 'full_attention']
        cfg.num_hidden_layers     # 2
    """
    cls = config_class(model_type)
    kwargs = tiny_kwargs(cls, model_type)
    fields = _fields(cls)
    amap = dict(getattr(cls, "attribute_map", {}) or {})
    named = {}
    for key, value in overrides.items():
        name = key if key in fields else amap.get(key)
        if name not in fields:
            raise TypeError(f"tiny_config({model_type!r}): {cls.__name__} has no field {key!r}")
        named[name] = value
    if "num_hidden_layers" in named and "num_hidden_layers" in kwargs:
        kwargs.update(_per_layer_fields(cls(), kwargs, named["num_hidden_layers"]))
    kwargs.update(named)
    try:
        return cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - say which family and what was asked
        raise TinyBuildError(f"{model_type}: {cls.__name__}(**tiny) raised {type(e).__name__}: {_first_line(e)}") from e


def _per_layer_fields(default, kwargs: dict, layers: int) -> dict[str, list]:
    """The per-layer lists of ``kwargs`` at ``layers`` layers (HF checks their length): a list
    with an entry per layer (``layer_types``) repeated, a list of layer indices (``moe_layers``)
    renumbered to the layers that repeat them."""
    n_default, n = getattr(default, "num_hidden_layers", None), kwargs["num_hidden_layers"]
    out = {}
    for field, value in kwargs.items():
        if not isinstance(value, list) or not isinstance(getattr(default, field, None), list) or not value:
            continue
        if len(getattr(default, field)) == n_default and len(value) == n:  # one entry per layer
            out[field] = [value[i % n] for i in range(layers)]
        elif all(isinstance(i, int) and not isinstance(i, bool) for i in value):  # layer indices
            out[field] = [i for i in range(layers) if i % n in set(value)]
    return out


def tiny_kwargs(cls, model_type: str | None = None) -> dict[str, Any]:
    """The keyword arguments :func:`tiny_config` passes to config class ``cls``."""
    default = cls()
    fields = _fields(cls)
    amap = dict(getattr(cls, "attribute_map", {}) or {})
    kw: dict[str, Any] = {}

    def field_of(name: str) -> str | None:
        if name in fields:
            return name
        target = amap.get(name)  # an alias of a field that has its own tiny value keeps that value
        return target if target in fields and target not in TINY else None

    # sizes, under the family's name for them
    for canon, value in TINY.items():
        for name in (canon, *ALIASES.get(canon, ())):
            f = field_of(name)
            if f is None or f in kw:
                continue
            if canon in ONLY_IF_SET and _value(default, f) in (None, 0, False):
                break
            kw[f] = value
            break

    # MLA: the rotary embedding's head_dim is the rope part of q/k (DeepSeek's configs set it so)
    # and every head has its own keys and values (kv heads = heads)
    if "qk_rope_head_dim" in kw and "head_dim" in fields:
        kw["head_dim"] = kw["qk_rope_head_dim"]
    if "kv_lora_rank" in kw and "num_key_value_heads" in kw:
        kw["num_key_value_heads"] = kw[field_of("num_attention_heads") or "num_attention_heads"]

    # per-layer lists: keep one layer per distinct combination of per-layer values
    n_default = _value(default, "num_hidden_layers")
    per_layer, index_lists = {}, {}
    for f in fields:
        v = _value(default, f)
        if not isinstance(v, list):
            continue
        if _is_index_list(v, n_default):
            index_lists[f] = v
        elif isinstance(n_default, int) and n_default > 0 and len(v) == n_default:
            per_layer[f] = v
    keep = _layers_to_keep(per_layer, n_default, TINY["num_hidden_layers"])
    n_layers = len(keep)
    for f, v in per_layer.items():
        scalar = kw.get(f)
        kw[f] = [scalar] * n_layers if isinstance(scalar, (int, float)) and not isinstance(scalar, bool) else [v[i] for i in keep]
    for f, v in index_lists.items():
        kw[f] = [new for new, old in enumerate(keep) if old in set(v)]
    f = field_of("num_hidden_layers")
    if f is not None:
        kw[f] = n_layers

    # MoE fields that count layers
    for name, value in (("first_k_dense_replace", 1), ("num_dense_layers", 1), ("decoder_sparse_step", 1)):
        if name in fields and isinstance(_value(default, name), int):
            kw[name] = min(_value(default, name), value) if name != "decoder_sparse_step" else value

    # randomness and outputs
    for f in fields:
        v = _value(default, f)
        if f.endswith(ZERO_SUFFIXES) and isinstance(v, (int, float)) and not isinstance(v, bool):
            kw[f] = 0.0
    for name, value in (("use_cache", False), ("output_router_logits", False)):
        if name in fields:
            kw[name] = value

    # special tokens inside the vocabulary
    kw.update(_token_ids(default, fields))

    # sub-configs: the text model tiny; vision/audio towers shrunk with the same sizes
    for name, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        if name in fields and isinstance(sub_cls, type):
            with_sub = tiny_kwargs(sub_cls)
            kw[name] = with_sub

    kw.update(FAMILY_OVERRIDES.get(model_type or getattr(cls, "model_type", ""), {}))
    return kw


def _value(cfg, name: str):
    """``cfg.name``, also for the per-layer attributes of heterogeneous configs (which refuse a global read)."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError
        return vars(cfg).get(name)


def _fields(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    import inspect

    return set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}


def _is_index_list(v: list, n_layers) -> bool:
    """A sorted list of distinct layer indices (``moe_layers``, ``mlp_only_layers``)."""
    if not isinstance(n_layers, int) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return False
    if not v:
        return True
    return all(a < b for a, b in zip(v, v[1:])) and v[0] >= 0 and v[-1] < n_layers and (len(v) > 2 or len(v) < n_layers)


def _layers_to_keep(per_layer: dict[str, list], n_default, n_min: int) -> list[int]:
    if not per_layer or not isinstance(n_default, int):
        return list(range(n_min))
    seen, keep = set(), []
    for i in range(n_default):
        key = tuple(repr(v[i]) for v in per_layer.values())
        if key not in seen:
            seen.add(key)
            keep.append(i)
    keep = keep[:MAX_LAYERS]
    for i in range(n_default):  # at least n_min layers: pad with the first layers not kept
        if len(keep) >= n_min:
            break
        if i not in keep:
            keep.append(i)
    return sorted(keep)


def _token_ids(default, fields: set[str]) -> dict[str, Any]:
    fixed = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    out: dict[str, Any] = {}
    spare = VOCAB - 1
    for f in sorted(fields):
        if not (f.endswith("_token_id") or f.endswith("_token_index") or f.endswith("_token_ids")):
            continue
        v = _value(default, f)
        if v is None:
            continue
        if f in fixed:
            out[f] = [fixed[f]] if isinstance(v, list) else fixed[f]
        elif isinstance(v, int) and not isinstance(v, bool):
            if v >= VOCAB:
                out[f] = spare
                spare -= 1
        elif isinstance(v, list) and v and all(isinstance(x, int) for x in v) and max(v) >= VOCAB:
            out[f] = [spare]
            spare -= 1
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ----------------------------------------------------------------------------- models


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """``AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))`` in float32,
    initialized under ``torch.manual_seed(seed)``, in train mode (dropouts are 0).

    Raises :class:`TinyBuildError` (with the reason) when the family cannot be built at tiny size.
    """
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    try:
        with _quiet():
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001
        raise TinyBuildError(f"{model_type}: AutoModelForCausalLM.from_config raised {type(e).__name__}: {_first_line(e)}") from e
    return model.float().train()


IGNORE_INDEX = -100  # the label HF's (and torch's) cross entropy skips


def tiny_inputs(batch: int = 2, seq: int = 8, vocab: int = VOCAB, seed: int = 0, prompt: int | None = None,
                masked: float = 0.25) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` int64 ``[batch, seq]``: distinct tensors, labels other
    values than the ids (ids avoid the special tokens 0..2), padded with -100 as a real
    batch is: the first ``prompt`` positions of every row (default ``seq // 4``, at least
    1; HF shifts labels, so position 0 is never scored and position 1 is) and about
    ``masked`` of the others at random.  Every row keeps its last label scored.

    Example::

        ids, labels = tiny_inputs()              # [2, 8]; labels[:, :2] == -100
        out = model(input_ids=ids, labels=labels)
        ids, labels = tiny_inputs(masked=0)      # the prompt only: as many scored tokens in every row
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = torch.randint(3, vocab, (batch, seq), generator=g)
    prompt = max(1, seq // 4) if prompt is None else prompt
    drop = torch.rand((batch, seq), generator=g) < masked
    drop[:, :prompt] = True
    drop[:, -1] = False
    return ids, labels.masked_fill(drop, IGNORE_INDEX)


def build_report(families: list[str] | None = None) -> dict[str, str]:
    """``{family: "ok" | why it cannot be built}``: builds every family's tiny model and runs a forward."""
    report = {}
    ids, labels = tiny_inputs()
    for family in families or decoder_families():
        try:
            model = tiny_model(family)
            with torch.no_grad():
                out = model(input_ids=ids, labels=labels)
            assert out.logits.shape[:2] == ids.shape, f"logits {tuple(out.logits.shape)}"
            report[family] = "ok"
        except Exception as e:  # noqa: BLE001
            report[family] = f"{type(e).__name__}: {_first_line(e)}"
    return report


class _quiet:
    """transformers' logging at error level for the block (tiny vocabularies make config warnings)."""

    def __enter__(self):
        from transformers.utils import logging

        self.level = logging.get_verbosity()
        logging.set_verbosity_error()

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self.level)
