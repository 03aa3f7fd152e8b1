"""FSDP2 mixed precision on HF models captured with torch.export.

``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` hands the
program bfloat16 parameters.  The capture keeps the dtypes HF's code reads from tensors as
reads (``fxshard/frontend/dtype_reads.py``), so the program computes in bfloat16 as HF's
model does with bfloat16 parameters.

The reference is one process running the plain HF model the way FSDP2's policy does: the
optimizer keeps float32 parameters, each step runs forward and backward on a bfloat16
copy of them (buffers stay float32, as FSDP2 leaves them), and the float32 parameters get
the gradient cast to float32.  Autocast would be another recipe: it keeps norms and the
residual stream in float32 and casts only at matmuls, so it would neither match the
numbers of bfloat16 parameters nor show that the program's activations are bfloat16.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

import fxshard
from fxshard import Plan
from fxshard.testing.hf_tiny import tiny_inputs, tiny_model

from harness import make_mesh, spawn

B = 4
STEPS = 3
LR = 1e-3
MAX_NORM = 0.5  # below the gradients' norm: clipping acts
RTOL = 1e-2     # bf16 keeps 8 bits of mantissa (2**-8 = 4e-3 relative per rounding); measured: 2e-4


def _batch():
    """Ids and labels (other tokens, -100 on the 2-token prompt): every row scores as many
    tokens, so the mean of each dp rank's mean loss is the global mean."""
    return tiny_inputs(batch=B, seq=8, masked=0.0)


def _one_process_bf16(model, ids, labels) -> tuple[list[float], list[float]]:
    """The reference: fp32 parameters held by the optimizer, forward + backward on a bf16
    copy, gradients back in fp32, torch's clipping and AdamW; the losses and the norms."""
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW(params.values(), lr=LR)
    losses, norms = [], []
    for _ in range(STEPS):
        copy = {n: p.detach().bfloat16().requires_grad_() for n, p in params.items()}
        loss = functional_call(model, copy, (), {"input_ids": ids, "labels": labels}).loss
        loss.backward()
        for n, p in params.items():
            p.grad = copy[n].grad.float()
        norms.append(torch.nn.utils.clip_grad_norm_(params.values(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


class _MatmulInputs(TorchDispatchMode):
    """The dtypes of every matmul's inputs while the mode is on."""

    MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
               torch.ops.aten.linear.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS:
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


def _check_fsdp_bf16(rank: int, world_size: int, family: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = make_mesh({"dp": 2, "tp": 2})
    dp = mesh.get_local_rank("dp")
    model = tiny_model(family)
    ids, labels = _batch()
    want, want_norms = _one_process_bf16(tiny_model(family), ids, labels)
    mine = slice(dp * B // 2, (dp + 1) * B // 2)

    plan = Plan.from_hf(mesh, model).replace(inputs={"input_ids": {"dp": Shard(0)}, "labels": {"dp": Shard(0)}}, fsdp="dp")
    sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids.clone(), "labels": labels.clone()})
    fxshard.fully_shard(sharded, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    block_out = []
    sharded.model.layers[0].register_forward_hook(lambda m, args, out: block_out.append(out.dtype))
    opt = torch.optim.AdamW(sharded.parameters(), lr=LR)
    got, norms = [], []
    for step in range(STEPS):
        matmuls = _MatmulInputs()
        with matmuls:
            out = sharded(input_ids=ids[mine], labels=labels[mine])
        out.loss.backward()
        if step == 0:
            # the program computes in bf16: every matmul (linears, attention) and the residual stream
            assert matmuls.dtypes == {torch.bfloat16}, matmuls.dtypes
            assert block_out == [torch.bfloat16] and out.logits.dtype == torch.bfloat16
            # FSDP2 keeps fp32 parameters and reduces their gradients in fp32
            for name, p in sharded.named_parameters():
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (name, p.dtype, p.grad.dtype)
                assert isinstance(p.grad, DTensor)
        norms.append(fxshard.clip_grad_norm_(sharded, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        loss = out.loss.detach().float()
        dist.all_reduce(loss, group=mesh.get_group("dp"))
        got.append(loss.item() / 2)
    assert norms[0] > MAX_NORM, norms  # the clip acted
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=RTOL, atol=0,
                               msg=lambda m: f"{family} losses {got} against one process {want}: {m}")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(want_norms), rtol=RTOL, atol=0,
                               msg=lambda m: f"{family} gradient norms {norms} against one process {want_norms}: {m}")
    if rank == 0:
        print(f"{family}: losses {got}, one process {want}; gradient norms {norms}, one process {want_norms}; "
              f"max relative differences {max(abs(a - b) / b for a, b in zip(got, want)):.1e} (loss), "
              f"{max(abs(a - b) / b for a, b in zip(norms, want_norms)):.1e} (norm)")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hf_fsdp2_bf16_params_fp32_reduce_trains_as_one_process(family):
    spawn(_check_fsdp_bf16, 4, family)


# ----------------------------------------------------------------------------- one process


def test_captured_program_reads_dtypes_and_keeps_fp32_numbers():
    model = tiny_model("llama")
    ids, labels = tiny_inputs(batch=2)
    gm = fxshard.trace(model, None, (), {"input_ids": ids.clone(), "labels": labels.clone()})
    code = gm.code
    # casts back to a dtype HF read from a tensor read it at run time: the norms' ``.to(input_dtype)``
    # (5 norms) and the rotary ``cos.to(x.dtype)``, ``sin.to(x.dtype)``
    reads = re.findall(r"(\w+) = (\w+)\.to\(dtype = (\w+)\)", code)
    follows = [(x, d) for _, x, d in reads if d.endswith("_dtype") or re.search(r"_dtype_\d+$", d)]
    assert len(follows) == 7, reads
    for _, d in follows:
        assert re.search(rf"\b{d} = \w+\.dtype\b", code), d
    # the casts the model writes as literals stay: the norms' upcast, the loss's logits.float()
    assert code.count(".to(dtype = torch.float32)") == 5 + 1 + 1  # + position_ids.float()
    assert "fxshard" not in code and "torch.ops" not in code.replace("torch.ops.aten", "")
    # the residual stream is the blocks' own values, never a norm's fp32 upcast of them
    upcasts = re.findall(r"(\w+) = \w+\.to\(dtype = torch\.float32\)", code)
    assert not [u for u in upcasts if re.search(rf"= (\w+ \+ {u}|{u} \+ \w+)\b", code)], upcasts

    # fp32: the numbers of the model, bit for bit (forward and parameter gradients)
    ref = model(input_ids=ids, labels=labels)
    ref.loss.backward()
    out = gm(input_ids=ids, labels=labels)
    out.loss.backward()
    assert torch.equal(out.loss, ref.loss) and torch.equal(out.logits, ref.logits)
    grads = dict(gm.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(grads[name].grad, p.grad), name

    # bf16 parameters (fp32 buffers, as FSDP2 casts them): the numbers of HF's model with bf16 parameters
    bf16 = {n: p.detach().bfloat16() for n, p in model.named_parameters()}
    ref = functional_call(model, bf16, (), {"input_ids": ids, "labels": labels})
    out = functional_call(gm, {n: bf16[n] for n, _ in gm.named_parameters()}, (), {"input_ids": ids, "labels": labels})
    assert out.logits.dtype == torch.bfloat16
    assert torch.equal(out.logits, ref.logits) and torch.equal(out.loss, ref.loss)


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        input_dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(input_dtype)


class _Block(torch.nn.Module):
    """The ways a dtype reaches a cast: a local holding a read, ``<tensor>.dtype``,
    ``.to(tensor)``, a module's parameter dtype, a literal, an argument."""

    def __init__(self):
        super().__init__()
        self.norm = _Norm()
        self.proj = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x, dtype=torch.float32):
        h = x + self.proj(self.norm(x))                      # the residual reads x, not the norm's upcast
        scores = torch.softmax(h, -1, dtype=torch.float32).to(h.dtype)
        gate = scores.to(self.proj.weight)
        fixed = h.to(dtype)                                  # an argument: not traced to a tensor, stays
        return h * gate + fixed.float()


def test_dtype_reads_in_a_small_module():
    from fxshard.frontend.capture import capture

    block = _Block()
    x = torch.randn(2, 3, 4)
    gm = capture(block, None, (x,))
    code = gm.code
    assert "to(dtype = x_dtype)" in code                     # the norm's input_dtype
    h = re.search(r"(add\w*) = x \+ linear", code).group(1)  # the residual is x, not the norm's upcast of it
    assert f"to(dtype = {h}_dtype)" in code                  # scores.to(h.dtype)
    assert "to(dtype = proj_weight_dtype)" in code           # scores.to(self.proj.weight)
    # literals stay: the norm's upcast, h.to(dtype) with the argument's default, fixed.float()
    assert code.count("to(dtype = torch.float32)") == 3
    torch.testing.assert_close(gm(x), block(x), rtol=0, atol=0)
    bf16 = {n: p.detach().bfloat16() for n, p in block.named_parameters()}
    xb = x.bfloat16()
    got = functional_call(gm, bf16, (xb,))
    want = functional_call(block, bf16, (xb,))
    # the argument's fp32 stays fp32, the rest follows x: as the module computes
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
