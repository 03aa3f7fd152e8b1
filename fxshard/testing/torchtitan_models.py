"""Small torchtitan models for equivalence tests (needs ``torchtitan``; CPU, no downloads).

:func:`tiny_llama3` builds torchtitan 0.3's own ``Llama3Model`` from its config classes,
the way its trainer does (``Config.build()`` on the meta device, ``to_empty``,
``init_states``), with shapes small enough for a CPU test; :func:`tiny_qwen3_moe` and
:func:`tiny_deepseek_v3` its MoE decoders (``MoE``: a top-k router with a
load-balancing bias buffer, ``RoutedExperts`` around stacked ``GroupedExperts``
weights, DeepSeek-V3 also shared experts, MLA attention and a dense first layer).

Forward signature (``torchtitan.models.common.decoder.Decoder.forward``)::

    logits = model(tokens)        # tokens: int64 [B, S], S <= max_seq_len
                                  # logits: float32 [B, S, vocab_size]
    model(tokens, positions=None, attention_masks=None)

``positions=None`` means ``0..S-1``.  With the default ``attn="sdpa"`` attention is
plain causal ``F.scaled_dot_product_attention`` and ``attention_masks`` must stay
``None``; with ``attn="flex"`` (torchtitan's default for language models) it must be
``model.get_attention_masks(positions)``, a flex ``BlockMask``.
"""
from __future__ import annotations

import torch

# Llama3 "debugmodel" proportions, shrunk: head_dim 16, 2 kv groups (GQA 2:1), SwiGLU.
_DEFAULTS = dict(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64,
    multiple_of=32, ffn_dim_multiplier=None, rope_theta=500000.0, rope_scaling="llama",
    rope="complex", fuse_qkv=True, attn="sdpa", tp_gemm_backend="default", enable_weight_tying=False,
    seed=0, dtype=torch.float32,
)


def tiny_llama3_config(**overrides):
    """The ``Llama3Model.Config`` that :func:`tiny_llama3` builds (same ``overrides``).

    Example::

        cfg = tiny_llama3_config(n_layers=4)
        cfg.layers[0].attention.n_kv_heads      # 2
    """
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3 import (  # Llama3's own init recipe (depth-scaled wo/w2/w3)
        _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init)

    a = _options(overrides)
    dim, vocab = a["dim"], a["vocab_size"]
    rope_args = dict(dim=dim // a["n_heads"], max_seq_len=a["max_seq_len"], theta=a["rope_theta"])
    if a["rope"] == "complex":  # Llama3's: a complex64 cache, view_as_complex in the graph
        rope = ComplexRoPE.Config(**rope_args, scaling=a["rope_scaling"])
    elif a["rope"] == "cossin":  # real cos/sin cache (torchtitan's other format; no Llama scaling)
        rope = CosSinRoPE.Config(**rope_args)
    else:
        raise ValueError(f"rope must be 'complex' or 'cossin', got {a['rope']!r}")
    layers = _build_llama3_layers(
        n_layers=a["n_layers"], dim=dim, n_heads=a["n_heads"], n_kv_heads=a["n_kv_heads"],
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=a["multiple_of"], ffn_dim_multiplier=a["ffn_dim_multiplier"]),
        rope=rope,
        fuse_qkv=a["fuse_qkv"], attn_backend="flex", tp_gemm_backend=a["tp_gemm_backend"],
    )
    if a["attn"] == "sdpa":
        # torchtitan refuses "sdpa" for language models only because its data loaders
        # emit per-document positions; a test feeds plain causal sequences, and SDPA
        # runs on CPU without compiling flex_attention.
        for layer in layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    elif a["attn"] != "flex":
        raise ValueError(f"attn must be 'sdpa' or 'flex', got {a['attn']!r}")
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=a["enable_weight_tying"],
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=layers,
    )


def tiny_llama3(**overrides) -> torch.nn.Module:
    """A small torchtitan ``Llama3Model`` on CPU with deterministic random weights.

    Defaults: dim 64, 2 layers, 4 heads, 2 kv heads (fused ``wqkv``), SwiGLU hidden
    192, vocab 128, RoPE cache for 64 positions, float32, seed 0.  Any of those can be
    overridden: ``dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len,
    multiple_of, ffn_dim_multiplier, rope_theta, rope_scaling, rope ("complex" |
    "cossin"), fuse_qkv, attn ("sdpa" | "flex"), tp_gemm_backend,
    enable_weight_tying, seed, dtype``.
    The caller's RNG state is left untouched.

    Example::

        model = tiny_llama3()
        logits = model(torch.randint(0, 128, (2, 16)))     # [2, 16, 128]
    """
    a = _options(overrides)
    config = tiny_llama3_config(**overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(a["seed"])
        with torch.device("meta"):  # as torchtitan's trainer: build on meta, then init states
            model = config.build()
        model.to_empty(device="cpu")
        model.init_states(buffer_device=torch.device("cpu"))  # params and the RoPE cache
    # Only floating parameters: the RoPE cache stays complex64 as torchtitan keeps it.
    for p in model.parameters():
        p.data = p.data.to(a["dtype"])
    return model.eval()


def tiny_qwen3_moe(*, n_layers: int = 2, num_experts: int = 4, top_k: int = 2, seed: int = 0) -> torch.nn.Module:
    """A small torchtitan ``Qwen3Model`` with MoE layers (torchtitan's own
    ``_build_qwen3_moe_layers``: softmax top-k with route norm, no shared experts,
    q/k norms, fused wqkv, GQA 2:1), dim 64, head_dim 16, expert hidden 32, vocab 128,
    float32, SDPA attention.

    Example::

        model = tiny_qwen3_moe()
        model.layers["0"].moe.routed_experts.inner_experts.w1_EFD.shape    # [4, 32, 64]
    """
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model

    dim, vocab, head_dim = 64, 128, 16
    layers = _build_qwen3_moe_layers(
        n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, moe_hidden_dim=32,
        num_experts=num_experts, top_k=top_k, fuse_qkv=True, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0),
    )
    config = Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=_qwen3_norm(dim), layers=_sdpa(layers),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_LINEAR_INIT),
    )
    return _build(config, seed)


def tiny_deepseek_v3(*, n_layers: int = 2, num_experts: int = 4, top_k: int = 2, score_func: str = "softmax",
                     seed: int = 0) -> torch.nn.Module:
    """A small torchtitan ``DeepSeekV3Model`` (torchtitan's own ``_build_dsv3_layers``):
    MLA attention (kv LoRA, rope/nope split), layer 0 dense, the others MoE with 2
    shared experts, dim 64, 4 heads, vocab 128, float32, SDPA attention.
    ``score_func``: the router's ``"softmax"`` or ``"sigmoid"`` (DeepSeek-V3 671B's).

    Example::

        model = tiny_deepseek_v3()
        model.layers["1"].moe.shared_experts.w1     # Linear(64, 64)
    """
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import _EMBEDDING_INIT, _NORM_INIT, _build_dsv3_layers, _output_linear_init
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

    dim, vocab, rope_dim = 64, 128, 8
    layers = _build_dsv3_layers(
        n_layers=n_layers, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=rope_dim, v_head_dim=16, mscale=0.70, dense_hidden_dim=128,
        moe_hidden_dim=32, num_experts=num_experts, num_shared_experts=2, router_top_k=top_k,
        router_score_func=score_func, attn_backend="flex", moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=64, theta=10000.0),
    )
    config = DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim, layers=_sdpa(layers),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
    )
    return _build(config, seed)


def _sdpa(layers):
    """torchtitan refuses "sdpa" for language models only because its loaders emit
    per-document positions; tests feed plain causal sequences (see tiny_llama3_config)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def _build(config, seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device("meta"):  # as torchtitan's trainer: build on meta, then init states
            model = config.build()
        model.to_empty(device="cpu")
        model.init_states(buffer_device=torch.device("cpu"))
    return model.eval()


def _options(overrides: dict) -> dict:
    unknown = sorted(set(overrides) - set(_DEFAULTS))
    if unknown:
        raise TypeError(f"tiny_llama3: unknown options {unknown}; known: {sorted(_DEFAULTS)}")
    return {**_DEFAULTS, **overrides}
