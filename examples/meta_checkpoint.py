"""A model no rank ever holds whole: built on the meta device, transformed, each rank
reading its slices of an HF checkpoint, trained, saved sharded, resumed elsewhere.

    python examples/meta_checkpoint.py        # 4 CPU processes (gloo), then one

What happens:

1. a tiny HF Llama is saved with ``save_pretrained`` in several safetensors files (the
   checkpoint you would download);
2. on 4 ranks (tp=4): the model is built on the meta device (no memory),
   ``fxshard.transform`` captures and shards it (no parameter is copied or allocated),
   ``fxshard.materialize(init=None)`` allocates this rank's shards and computes the
   rotary table, ``fxshard.load_hf_checkpoint`` reads only this rank's slices; the
   logits equal the unsharded model's;
3. 2 AdamW steps, then ``fxshard.save`` writes a DCP checkpoint (shards + optimizer state);
4. in this process, without a process group, the plain single-device model loads that
   checkpoint with ``fxshard.load`` and takes 2 more steps, ending where the tp=4 run
   ends after 4 steps.
"""
from __future__ import annotations

import os
import tempfile

import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM

import fxshard
from fxshard.testing.launch import spawn

CONFIG = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def steps(model, opt, n):
    for _ in range(n):
        opt.zero_grad()
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()


def ranks(rank: int, world_size: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    with torch.device("meta"):
        model = LlamaForCausalLM(CONFIG)
    sharded = fxshard.transform(model, fxshard.Plan.from_hf(mesh, model),
                                example_kwargs={"input_ids": IDS, "labels": IDS})
    fxshard.materialize(sharded, model, init=None)
    fxshard.load_hf_checkpoint(sharded, os.path.join(root, "hf"))
    reference = LlamaForCausalLM.from_pretrained(os.path.join(root, "hf"))
    with torch.no_grad():
        diff = (sharded(input_ids=IDS, labels=IDS).logits - reference(input_ids=IDS).logits).abs().max().item()
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    steps(sharded, opt, 2)
    fxshard.save(sharded, os.path.join(root, "dcp"), optimizer=opt)
    steps(sharded, opt, 2)
    full = fxshard.full_state_dict(sharded)
    if rank == 0:
        local = sum(t.numel() for t in sharded.parameters())
        print(f"tp={world_size}: rank 0 holds {local} of {sum(t.numel() for t in reference.parameters())} "
              f"parameters; logits vs the unsharded model: max |diff| {diff:.1e}")
        torch.save(full, os.path.join(root, "after4.pt"))


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        LlamaForCausalLM(CONFIG).save_pretrained(os.path.join(root, "hf"), max_shard_size="200KB")
        print(f"HF checkpoint: {len([f for f in os.listdir(os.path.join(root, 'hf')) if f.endswith('.safetensors')])} "
              f"safetensors files")
        spawn(ranks, 4, root)
        model = LlamaForCausalLM.from_pretrained(os.path.join(root, "hf"))  # any weights: they are replaced
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fxshard.load(model, os.path.join(root, "dcp"), optimizer=opt)
        steps(model, opt, 2)
        want = torch.load(os.path.join(root, "after4.pt"))
        worst = max((model.state_dict()[k] - v).abs().max().item() for k, v in want.items())
        print(f"one device, resumed from the tp=4 checkpoint, 2 more steps: max |diff| to the tp=4 run {worst:.1e}")
        assert worst < 1e-4


if __name__ == "__main__":
    main()
