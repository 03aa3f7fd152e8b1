"""``fxshard.clip_grad_norm_`` / ``fxshard.grad_norm``: the whole model's gradient norm, the
same on every rank and equal to torch's on one device, over a training loop with
clipping (SGD, 3 steps, ``max_norm`` small enough that every step clips), on the meshes
fxshard makes: tp with an uneven vocabulary, FSDP2 over dp x tp, experts under ep, KV
heads shared by 2 ranks at tp=4; 2-norm and inf-norm.  Torch's own ``clip_grad_norm_`` on
a sharded module's parameters raises a PlanError.  Under ep and with shared KV heads, an AdamW
state saved and loaded resumes bit for bit."""
import copy
import math
import os

import pytest
import torch
from torch.distributed.tensor import Shard

pytest.importorskip("transformers")

import fxshard
from harness import make_mesh, rank_value, simulated, spawn
from fxshard.testing.hf_tiny import tiny_model

STEPS, LR, MAX_NORM = 3, 1.0, 0.1
# SGD, not AdamW: Adam's update is nearly invariant to a global scale of the gradient, so only SGD's
# parameters show a wrong clipping factor
TOL = dict(rtol=1e-4, atol=1e-5)


def _batch(vocab: int, batch: int = 4, seq: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = torch.randint(3, vocab, (batch, seq), generator=g)
    labels[:, :2] = -100  # a masked prompt: the same count of scored tokens in every row
    return ids, labels


def _llama(vocab: int = 129, layers: int = 2):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def _qwen2_two_kv_heads():
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config)


def _one_device(model, batches, norm_type=2.0):
    """torch's clipping on one device: the norms before clipping, and the trained model."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = sum(model(input_ids=i, labels=l).loss for i, l in batches) / len(batches)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type))
        opt.step()
    return torch.stack(norms), model


def _sharded_run(sharded, ids, labels, norm_type=2.0, clip=None, opt=None, steps=STEPS):
    opt = opt or torch.optim.SGD(sharded.parameters(), lr=LR)
    norms = []
    for _ in range(steps):
        opt.zero_grad()
        sharded(input_ids=ids, labels=labels).loss.backward()
        norms.append((clip or fxshard.clip_grad_norm_)(sharded, MAX_NORM, norm_type))
        opt.step()
    return torch.stack(norms)


def _resumes_bit_for_bit(make_sharded, ids, labels, path):
    """AdamW state saved after a clipped step and loaded into a fresh transform: the next
    step is bit for bit the uninterrupted one (optimizer states laid out as their parameters)."""
    first = make_sharded()
    opt = torch.optim.AdamW(first.parameters(), lr=1e-3)
    _sharded_run(first, ids, labels, opt=opt, steps=1)
    fxshard.save(first, path, optimizer=opt)
    _sharded_run(first, ids, labels, opt=opt, steps=1)
    again = make_sharded()
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-3)
    fxshard.load(again, path, optimizer=opt2)
    _sharded_run(again, ids, labels, opt=opt2, steps=1)
    want = fxshard.full_state_dict(first)
    for name, t in fxshard.full_state_dict(again).items():
        assert torch.equal(t, want[name]), f"resumed from {path}: {name}"


def _assert_same(got_norms, want_norms, sharded, want_state, what):
    torch.testing.assert_close(got_norms, want_norms, **TOL, msg=lambda m: f"{what}: norms: {m}")
    full = fxshard.full_state_dict(sharded)
    for name, t in want_state.items():
        torch.testing.assert_close(full[name], t, **TOL, msg=lambda m: f"{what}: {name} after {STEPS} clipped steps: {m}")


def _two_ranks(rank: int, world_size: int, root: str) -> None:
    ids, labels = _batch(129)
    # HF Llama at tp=2 with HF's plan; vocab 129 on 2 ranks is cut 65 / 64; 2-norm, then inf-norm
    mesh = make_mesh({"tp": 2})
    # the 2-norm given the module, the inf-norm given a list of its parameters
    as_list = lambda m, *a: fxshard.clip_grad_norm_(list(m.parameters()), *a)  # noqa: E731
    for norm_type, clip in ((2.0, None), (math.inf, as_list)):
        model = _llama()
        want_norms, trained = _one_device(model, [(ids, labels)], norm_type)
        sharded = fxshard.transform(model, fxshard.Plan.from_hf(mesh, model),
                                    example_kwargs={"input_ids": ids, "labels": labels})
        got = _sharded_run(sharded, ids, labels, norm_type, clip=clip)
        _assert_same(got, want_norms, sharded, trained.state_dict(), f"llama tp=2 norm_type={norm_type}")

    # torch's own clip on the shards is caught
    with pytest.raises(fxshard.PlanError, match="fxshard.clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1.0)

    # Mixtral, experts split over ep=2 by HF's plan (each rank holds its own experts)
    ep = make_mesh({"ep": 2})
    model = tiny_model("mixtral")
    vocab = model.config.vocab_size
    ids, labels = _batch(vocab, seed=1)
    want_norms, trained = _one_device(model, [(ids, labels)])
    sharded = fxshard.transform(model, fxshard.Plan.from_hf(ep, model), example_kwargs={"input_ids": ids, "labels": labels})
    got = _sharded_run(sharded, ids, labels)
    _assert_same(got, want_norms, sharded, trained.state_dict(), "mixtral ep=2")
    plan = fxshard.Plan.from_hf(ep, model)
    _resumes_bit_for_bit(lambda: fxshard.transform(model, plan, example_kwargs={"input_ids": ids, "labels": labels}),
                         ids, labels, os.path.join(root, "mixtral_ep2"))


def _four_ranks(rank: int, world_size: int, root: str) -> None:
    # FSDP2 over dp, HF's plan over tp: each dp rank its half of the batch (FSDP2 averages over dp)
    mesh = make_mesh({"dp": 2, "tp": 2})
    dp = mesh.get_local_rank("dp")
    ids, labels = _batch(129)
    halves = [(ids[:2], labels[:2]), (ids[2:], labels[2:])]
    model = _llama()
    want_norms, trained = _one_device(model, halves)
    plan = fxshard.Plan.from_hf(mesh, model).replace(inputs={"input_ids": {"dp": Shard(0)}, "labels": {"dp": Shard(0)}},
                                                     fsdp="dp")
    sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids, "labels": labels})
    fxshard.fully_shard(sharded, mesh)
    args, mine = fxshard.shard_inputs(sharded, input_ids=ids, labels=labels)  # this rank's rows, as the plan lays them out
    assert args == () and torch.equal(mine["input_ids"], halves[dp][0]) and torch.equal(mine["labels"], halves[dp][1])
    got = _sharded_run(sharded, mine["input_ids"], mine["labels"])
    # the logged loss: every rank's mean, averaged over the mesh, is one device's loss (equal token counts)
    logged = fxshard.reduce_over(sharded(**mine).loss.detach(), op="avg")
    want = sum(trained(input_ids=i, labels=l).loss for i, l in halves) / 2
    torch.testing.assert_close(logged, want.detach(), **TOL)
    _assert_same(got, want_norms, sharded, trained.state_dict(), "llama dp x tp, FSDP2")

    # Qwen2's 2 KV heads at tp=4: each head held by 2 ranks, counted once
    tp4 = make_mesh({"tp": 4})
    model = _qwen2_two_kv_heads()
    ids, labels = _batch(128, seed=2)
    want_norms, trained = _one_device(model, [(ids, labels)])
    plan = fxshard.Plan.from_hf(tp4, model)
    assert plan.specs["model.layers.*.self_attn.k_proj"].heads == 2, plan
    sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids, "labels": labels})
    got = _sharded_run(sharded, ids, labels)
    _assert_same(got, want_norms, sharded, trained.state_dict(), "qwen2 tp=4, 2 KV heads")
    _resumes_bit_for_bit(lambda: fxshard.transform(model, plan, example_kwargs={"input_ids": ids, "labels": labels}),
                         ids, labels, os.path.join(root, "qwen2_tp4"))


def test_clip_grad_norm_real_gloo_two_ranks(tmp_path):
    spawn(_two_ranks, 2, str(tmp_path))


@pytest.mark.sweep  # two real ranks run in the main stage
def test_clip_grad_norm_real_gloo_four_ranks(tmp_path):
    spawn(_four_ranks, 4, str(tmp_path))


def test_grad_norm_simulated_sequence_parallel():
    """Sequence parallelism: replicated norm weights (their gradient synced over tp) next
    to column and row shards; every rank's norm is one device's."""
    ids, labels = _batch(128)
    model = _llama(vocab=128, layers=1)
    ref = copy.deepcopy(model)
    ref(input_ids=ids, labels=labels).loss.backward()
    want = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    with simulated({"tp": 2}) as mesh:
        plan = fxshard.Plan.from_hf(mesh, model, sequence_parallel=True)
        sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids, "labels": labels})
        sharded(input_ids=ids.clone(), labels=labels.clone()).loss.backward()
        got = fxshard.grad_norm(sharded)
        for r in (0, 1):
            torch.testing.assert_close(rank_value(got, r), want, **TOL)
