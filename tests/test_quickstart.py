"""The README's "Quick start with a HuggingFace model", as a new user runs it, on real gloo
ranks (tp=2): transformed with ``example_kwargs={"input_ids": ids, "labels": ids}``
exactly as written there (one tensor under two names), then called with *other* ids and
labels that carry -100 padding (the prompt masked, as in a real batch).  The loss and the
logits equal the model's on one device, with the plan from ``Plan.from_hf`` and with the
plan ``auto_plan`` finds.  A capture that binds ``labels`` to ``input_ids`` by identity
computes the loss of the wrong labels, which this test sees."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from harness import make_mesh, spawn

ATOL = 1e-5
RTOL = 1e-5


def _readme_model():
    """The README's model and example ids (its config, seeded so every rank builds the same)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
                                         num_key_value_heads=4, intermediate_size=512, vocab_size=1024))
    ids = torch.randint(0, 1024, (2, 64))
    return model, ids


def _full_logits(logits: torch.Tensor, vocab: int, mesh) -> torch.Tensor:
    """The logits as one device has them: a vocab-sharded output gathered over ``tp``."""
    if logits.shape[-1] == vocab:
        return logits
    import torch.distributed as dist

    parts = [torch.empty_like(logits) for _ in range(mesh.size())]
    dist.all_gather(parts, logits.contiguous(), group=mesh.get_group("tp"))
    return torch.cat(parts, dim=-1)


def _check_quickstart(rank: int, world_size: int) -> None:
    import fxshard
    from fxshard.testing.hf_tiny import tiny_inputs

    mesh = make_mesh({"tp": world_size})
    model, ids = _readme_model()
    vocab = model.config.vocab_size
    plans = {
        "Plan.from_hf": fxshard.Plan.from_hf(mesh, model),
        "auto_plan": fxshard.auto_plan(model, mesh, example_kwargs={"input_ids": ids, "labels": ids}),
    }
    # other batches than the example: the same shape, and another batch and sequence length
    batches = [tiny_inputs(2, 64, vocab, seed=1), tiny_inputs(3, 40, vocab, seed=2)]
    for name, plan in plans.items():
        sharded = fxshard.transform(model, plan, example_kwargs={"input_ids": ids, "labels": ids})
        for other_ids, labels in batches:
            assert not torch.equal(other_ids, ids) and (labels == -100).any()
            with torch.no_grad():
                want = model(input_ids=other_ids, labels=labels)
                got = sharded(input_ids=other_ids, labels=labels)
            where = f"rank {rank}, {name}, batch {tuple(other_ids.shape)}"
            torch.testing.assert_close(got.loss, want.loss, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: loss: {m}")
            torch.testing.assert_close(_full_logits(got.logits, vocab, mesh), want.logits, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{where}: logits: {m}")


def test_readme_quickstart_with_other_labels_real_gloo():
    spawn(_check_quickstart, 2)
