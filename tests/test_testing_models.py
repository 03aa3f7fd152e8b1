"""Sanity checks for the test model zoo in fxshard/testing/models.py."""
import itertools

import pytest
import torch
import torch.fx

from fxshard.testing import models as M

SHAPES = [(2, 8), (3, 5)]

LLAMA_COMBOS = [
    dict(rope=rope, fused_qkv=fq, fused_w13=fw, norm=norm)
    for rope, fq, fw, norm in itertools.product(
        ["complex", "real"], [False, True], [False, True], ["module", "written"]
    )
]


def _ids(combo):
    return ",".join(f"{k}={v}" for k, v in combo.items())


def _check_trace(model, make_input):
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        for b, s in SHAPES:
            x = make_input(b, s)
            ref = model(x)
            out = gm(x)
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
    return gm


@pytest.mark.parametrize("combo", LLAMA_COMBOS, ids=_ids)
def test_llama_traces(combo):
    model = M.llama(seed=0, **combo)
    v = model.args.vocab_size
    gm = _check_trace(model, lambda b, s: M.tokens(b, s, v, seed=b * 100 + s))
    out = gm(M.tokens(2, 8, v))
    assert out.shape == (2, 8, v) and out.dtype == torch.float32
    # full-length sequence works too
    gm(M.tokens(1, model.args.max_seq_len, v))
    # head counts appear as literal ints in view calls
    views = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "view"]
    hd = model.args.head_dim
    assert any(n.args[3:5] == (model.args.n_heads, hd) for n in views)
    assert any(n.args[3:5] == (model.args.n_kv_heads, hd) for n in views)


def test_llama_mha_no_repeat():
    model = M.llama(seed=1, n_kv_heads=4)
    gm = _check_trace(model, lambda b, s: M.tokens(b, s, 128, seed=s))
    assert not any(n.target is torch.repeat_interleave for n in gm.graph.nodes)


def test_llama_deterministic_and_seeded():
    state = torch.random.get_rng_state()
    a, b, c = M.llama(seed=0), M.llama(seed=0), M.llama(seed=1)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    assert not torch.equal(a.output.weight, c.output.weight)
    # norm weights non-trivial
    assert not torch.allclose(a.layers[0].attention_norm.weight, torch.ones(64))


@pytest.mark.parametrize("rope", ["complex", "real"])
@pytest.mark.parametrize("norm", ["module", "written"])
def test_llama_fused_equals_unfused(rope, norm):
    ref = M.llama(seed=3, rope=rope, norm=norm)
    x = M.tokens(2, 7, 128, seed=5)
    with torch.no_grad():
        y = ref(x)
    for fq, fw in [(True, False), (False, True), (True, True)]:
        fused = M.llama(seed=99, rope=rope, norm=norm, fused_qkv=fq, fused_w13=fw)
        fused.load_state_dict(M.fuse_llama_state_dict(ref.state_dict(), fused.args))
        with torch.no_grad():
            torch.testing.assert_close(fused(x), y, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(torch.fx.symbolic_trace(fused)(x), y, rtol=1e-5, atol=1e-5)


def test_llama_module_vs_written_norm():
    a = M.llama(seed=4, norm="module")
    b = M.llama(seed=4, norm="written")
    x = M.tokens(2, 6, 128)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)


def test_llama_real_rope_matches_complex():
    a = M.llama(seed=6, rope="complex")
    b = M.llama(seed=0, rope="real")
    b.load_state_dict(M.complex_to_real_rope_state_dict(a.state_dict(), a.args))
    x = M.tokens(2, 9, 128, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(b(x), a(x), rtol=1e-5, atol=1e-5)


def test_llama_names():
    names = {n for n, _ in M.llama(n_layers=1).named_parameters()}
    assert names == {
        "tok_embeddings.weight",
        "layers.0.attention_norm.weight",
        "layers.0.attention.wq.weight",
        "layers.0.attention.wk.weight",
        "layers.0.attention.wv.weight",
        "layers.0.attention.wo.weight",
        "layers.0.ffn_norm.weight",
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight",
        "norm.weight",
        "output.weight",
    }
    fused = dict(M.llama(n_layers=1, fused_qkv=True, fused_w13=True).named_parameters())
    assert fused["layers.0.attention.wqkv.weight"].shape == (64 + 2 * 32, 64)
    assert fused["layers.0.feed_forward.w13.weight"].shape == (2 * 128, 64)


def test_llama_causal():
    model = M.llama(seed=0)
    x = M.tokens(1, 10, 128)
    x2 = x.clone()
    x2[0, 7:] = (x2[0, 7:] + 1) % 128
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :7], model(x2)[:, :7])
        assert not torch.allclose(model(x)[:, 7:], model(x2)[:, 7:])


@pytest.mark.parametrize("tied", [False, True])
def test_gpt2_traces(tied):
    model = M.gpt2(seed=0, tied=tied)
    gm = _check_trace(model, lambda b, s: M.tokens(b, s, 128, seed=s))
    assert gm(M.tokens(2, 32, 128)).shape == (2, 32, 128)
    # biases are non-zero
    assert model.h[0].attn.c_attn.bias.abs().min() > 0
    assert not torch.allclose(model.ln_f.weight, torch.ones(64))
    if tied:
        assert model.lm_head.weight is model.wte.weight
        assert gm.lm_head.weight is gm.wte.weight
        assert "lm_head.weight" not in dict(model.named_parameters())
    else:
        assert not torch.equal(model.lm_head.weight, model.wte.weight)


def test_gpt2_tied_shares_grad():
    model = M.gpt2(seed=0, tied=True)
    n_params = len(list(model.parameters()))
    assert n_params == len(list(M.gpt2(seed=0).parameters())) - 1
    loss = M.WithLoss(model)(M.tokens(2, 5, 128), M.tokens(2, 5, 128, seed=1))
    loss.backward()
    g = model.wte.weight.grad
    assert g is not None and model.lm_head.weight.grad is g


def test_gpt2_names():
    names = [n for n, _ in M.gpt2(n_layers=1).named_parameters()]
    assert names == [
        "wte.weight", "wpe.weight",
        "h.0.ln_1.weight", "h.0.ln_1.bias",
        "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias",
        "h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias",
        "h.0.ln_2.weight", "h.0.ln_2.bias",
        "h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias",
        "h.0.mlp.c_proj.weight", "h.0.mlp.c_proj.bias",
        "ln_f.weight", "ln_f.bias",
        "lm_head.weight",
    ]


@pytest.mark.parametrize("kw", [{}, dict(bias=False), dict(act="relu"), dict(dim=16, hidden=48)])
def test_mlp_traces(kw):
    model = M.mlp(seed=0, **kw)
    d = model.dim
    g = torch.Generator().manual_seed(0)
    _check_trace(model, lambda b, s: torch.randn(b, s, d, generator=g))
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(5, d)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_with_loss(family, reduction):
    model = M.llama(seed=0) if family == "llama" else M.gpt2(seed=0)
    wl = M.WithLoss(model, reduction=reduction)
    gm = torch.fx.symbolic_trace(wl)
    for b, s in SHAPES:
        x, t = M.tokens(b, s, 128, seed=1), M.tokens(b, s, 128, seed=2)
        ref = wl(x, t)
        torch.testing.assert_close(gm(x, t), ref, rtol=0, atol=0)
        expect = torch.nn.functional.cross_entropy(
            model(x).reshape(-1, 128), t.reshape(-1), reduction=reduction
        )
        torch.testing.assert_close(ref, expect)
        if reduction == "none":
            assert ref.shape == (b * s,)
    # backward through the traced graph reaches every parameter (norm weights included)
    gm(M.tokens(2, 4, 128), M.tokens(2, 4, 128, seed=3)).sum().backward()
    for n, p in gm.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, n
