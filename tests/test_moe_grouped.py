"""Routed experts as grouped GEMMs (``fxshard.runtime.routed_experts``): ``grouped_mm``
against one matmul per expert (native kernel and loop, the sentinel's rows), HF's experts
against fxshard's grouped forward (fp32, with and without an ep rank's sentinel routing),
shapes and FLOPs on the meta device, and what the backward keeps: O(rows x (hidden +
width)), where HF's ``batched_mm`` keeps an expert's weights per row."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fxshard.runtime.routed_experts import follows_hf_experts, grouped_experts_forward, grouped_mm, use_grouped_experts

pytest.importorskip("transformers")


def _per_expert(x, w, counts):
    """The reference: each expert's contiguous rows times its matrix, zero rows after the last."""
    out, start = torch.zeros(x.shape[0], w.shape[-1]), 0
    for g, n in enumerate(counts):
        out[start:start + n] = x[start:start + n] @ w[g]
        start += n
    return out


@pytest.mark.parametrize("k", [8, 5], ids=["native-layout", "loop-layout"])  # K=5 fp32: strides not 16-byte multiples
def test_grouped_mm_is_one_matmul_per_expert(k):
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 4, 2]  # an expert without rows; 2 sentinel rows at the end
    x = torch.randn(11, k, generator=g, requires_grad=True)
    w = torch.randn(4, k, 6, generator=g, requires_grad=True)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = grouped_mm(x, w, offs)
    want = _per_expert(x, w, counts)
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
    assert y[9:].eq(0).all()
    gy = torch.randn(y.shape, generator=g)
    gx, gw = torch.autograd.grad(y, (x, w), gy)
    wx, ww = torch.autograd.grad(want, (x, w), gy)
    torch.testing.assert_close(gx, wx, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gw, ww, atol=1e-6, rtol=1e-6)
    assert gw[1].eq(0).all() and gx[9:].eq(0).all()


def _experts(model_type: str, meta: bool = False, **overrides):
    from transformers import AutoModelForCausalLM

    from fxshard.testing.hf_tiny import tiny_config

    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg)
    return next(m for n, m in model.named_modules() if n.endswith("mlp.experts")), cfg


def _routing(n_tokens, n_experts, k, hidden, seed=1):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n_tokens, hidden, generator=g, requires_grad=True)
    idx = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n_tokens)])
    w = torch.rand(n_tokens, k, generator=g, requires_grad=True)
    return h, idx, w


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("sentinel", [False, True], ids=["all-experts", "ep-rank"])
def test_grouped_forward_is_hf_eager(model_type, sentinel):
    """Output and every gradient (tokens, routing weights, both stacked weights) as HF's eager
    experts, fp32.  ``ep-rank``: the routing an ep rank sees (half the experts its own, the
    others' choices at the sentinel ``num_experts`` with weight 0)."""
    experts, cfg = _experts(model_type)
    assert follows_hf_experts(experts)
    experts.config._experts_implementation = "eager"
    n = experts.gate_up_proj.shape[0]
    h, idx, w = _routing(13, n, 2, cfg.hidden_size)
    if sentinel:
        experts.num_experts = n // 2
        experts._is_expert_parallel = True
        foreign = idx >= n // 2
        idx, w = idx.masked_fill(foreign, n // 2), w.masked_fill(foreign, 0.0)
    params = (h, w, experts.gate_up_proj, experts.down_proj)
    want = experts(h, idx, w)
    want_grads = torch.autograd.grad(want.square().sum(), params, allow_unused=True)
    got = grouped_experts_forward(experts, h, idx, w)
    got_grads = torch.autograd.grad(got.square().sum(), params, allow_unused=True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, atol=1e-6, rtol=1e-5)
    assert use_grouped_experts(experts) and not use_grouped_experts(experts)  # swapped once
    torch.testing.assert_close(experts(h, idx, w), want, atol=1e-6, rtol=1e-5)


def test_meta_shapes_and_flops():
    """On meta (the planner's and the trainer's capture) in fp32: the shape, and the FLOPs of
    the grouped GEMMs (every row meets one expert: 2 x rows x hidden x (2I + I))."""
    experts, cfg = _experts("mixtral", meta=True)
    n_tokens, k, hidden, width = 16, cfg.num_experts_per_tok, cfg.hidden_size, cfg.intermediate_size
    h = torch.empty(n_tokens, hidden, device="meta", requires_grad=True)
    idx = torch.zeros(n_tokens, k, dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as counter:
        out = grouped_experts_forward(experts, h, idx, torch.empty(n_tokens, k, device="meta"))
    assert out.shape == (n_tokens, hidden) and out.is_meta and out.requires_grad
    assert counter.get_total_flops() == 2 * n_tokens * k * hidden * 3 * width
    # an ep=2 rank that sees every token computes the half of the rows its experts own
    x, w = torch.empty(64, 16, device="meta"), torch.empty(4, 16, 8, device="meta")
    with FlopCounterMode(display=False) as counter:
        grouped_mm(x, w, torch.empty(4, dtype=torch.int32, device="meta"), 0.5)
    assert counter.get_total_flops() == 2 * 32 * 16 * 8


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward, parameters aside."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter) and t.untyped_storage()._cdata not in params:
            seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    params = set()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(params)
    return sum(seen.values())


def test_no_expert_weights_per_token():
    """Mixtral-8x7B's experts (hidden 4096, width 14336, top-2 of 8) on 1024 tokens, on meta:
    the grouped forward keeps O(rows x (hidden + width)); HF's batched_mm keeps an expert's
    [2I, H] and [H, I] per row (0.66 GiB a token)."""
    experts, cfg = _experts("mixtral", meta=True, hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                            num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=1)
    n_tokens, k, hidden, width = 1024, 2, 4096, 14336
    rows = n_tokens * k

    def run(impl):
        def fn(params):
            params.update(p.untyped_storage()._cdata for p in experts.parameters())
            h = torch.empty(n_tokens, hidden, device="meta", requires_grad=True)
            idx = torch.zeros(n_tokens, k, dtype=torch.long, device="meta")
            w = torch.empty(n_tokens, k, device="meta", requires_grad=True)
            if impl == "fxshard":
                grouped_experts_forward(experts, h, idx, w)
            else:
                experts.config._experts_implementation = impl
                experts(h, idx, w)
        return _saved_bytes(fn)

    grouped = run("fxshard")
    # the rows (x), gate | up, the activation's inputs and output, the down projection's output, indices
    bound = 4 * rows * (2 * hidden + 4 * width) + 64 * rows
    assert grouped <= bound, (grouped, bound)
    weights_per_row = 4 * rows * 3 * width * hidden
    assert run("batched_mm") >= weights_per_row > 100 * grouped


def test_sharded_hf_experts_run_grouped(family="mixtral", mesh_shape={"ep": 2}):
    """Through ``Plan.from_hf`` and the transform, in simulated ranks: the experts of every layer
    run fxshard's grouped forward (HF's config names grouped_mm), and logits, loss, every
    gradient and 2 SGD steps equal one device's."""
    import functools

    import fxshard
    from equivalence import check_simulated
    from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

    ids, labels = tiny_inputs()
    sharded = check_simulated(functools.partial(tiny_model, family),
                              lambda mesh: fxshard.Plan.from_hf(mesh, tiny_model(family)), (), mesh_shape,
                              kwargs={"input_ids": ids, "labels": labels}, select=lambda out: out.logits,
                              loss_fn=lambda out: out.loss, replicated_loss=True, lr=0.2)
    experts = [m for n, m in sharded.named_modules() if n.endswith("mlp.experts")]
    assert experts
    for m in experts:
        assert any(vars(c).get("forward") is grouped_experts_forward for c in type(m).__mro__), type(m).__mro__


def test_a_rank_without_rows():
    """An all-to-all dispatch can bring a rank no (token, choice) row at all: [0, H] out, zero gradients."""
    experts, cfg = _experts("qwen3_moe")
    h = torch.zeros(0, cfg.hidden_size, requires_grad=True)
    out = grouped_experts_forward(experts, h, torch.zeros(0, 1, dtype=torch.long), torch.ones(0, 1))
    out.sum().backward()
    assert out.shape == (0, cfg.hidden_size) and experts.gate_up_proj.grad.eq(0).all()


def test_under_bf16_autocast():
    """``--bf16`` without FSDP2 runs under autocast: the grouped GEMMs compute in bf16 as HF's
    linear layers would, within bf16's tolerance of fp32."""
    experts, cfg = _experts("mixtral")
    h, idx, w = _routing(13, experts.gate_up_proj.shape[0], 2, cfg.hidden_size)
    want = grouped_experts_forward(experts, h, idx, w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = grouped_experts_forward(experts, h, idx, w)
    got.float().sum().backward()
    assert experts.down_proj.grad is not None and experts.down_proj.grad.dtype == torch.float32
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
