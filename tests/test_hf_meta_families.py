"""Models bigger than one host, across HF families fxshard did not write: each family's
tiny config built on the meta device, transformed with its own TP plan at tp=2
(offline ranks), then (1) ``materialize`` with HF's init equals the slices of the
single-device init under the same seed, and (2) ``materialize(init=None)`` +
``load_hf_checkpoint`` of a ``save_pretrained`` checkpoint gives every rank the slices
of the saved tensors.  Families: a spread of the dense families the HF conformance
benchmark finds exact (biases, fused qkv, q/k norms, partial rotary, scaled embeddings,
parallel blocks)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import fxshard  # noqa: E402
from fxshard import MeshSpec, Plan  # noqa: E402
from fxshard.state.materialize import _allocate  # noqa: E402
from fxshard.testing.hf_tiny import tiny_config  # noqa: E402

from equivalence import expected_local  # noqa: E402

FAMILIES = ["gpt_neox",  # its checkpoint names lm_head `embed_out` (HF's rename table)
            "gemma", "gemma3_text", "gpt_neox", "phi", "olmo2", "starcoder2", "cohere", "granite", "nemotron", "glm4",
            "qwen2", "mistral"]
IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _slices_equal(sharded, mesh, full: dict) -> list[str]:
    bad = []
    for fqn, t in list(sharded.state_dict().items()) + list(sharded.named_buffers()):
        if fqn not in full:
            continue
        if not torch.equal(t, expected_local(sharded, mesh, full[fqn], fqn).to(t.dtype)):
            bad.append(fqn)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_materializes_and_loads_its_slices(family, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    ref = copy.deepcopy(meta)
    _allocate(ref, torch.device("cpu"))
    for m in ref.modules():
        m.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(0)
    ref.initialize_weights()
    init_full = {**ref.state_dict(), **dict(ref.named_buffers())}
    ref.save_pretrained(tmp_path, max_shard_size="60KB")
    saved = ref.state_dict()
    for r in range(2):
        mesh = MeshSpec(("tp",), (2,), coordinate=(r,))
        sharded = fxshard.transform(meta, Plan.from_hf(mesh, meta), example_kwargs={"input_ids": IDS})
        torch.manual_seed(0)
        fxshard.materialize(sharded, meta)
        assert _slices_equal(sharded, mesh, init_full) == [], f"{family} rank {r}: materialize != init slices"
        fxshard.materialize(sharded, meta, init=None)
        fxshard.load_hf_checkpoint(sharded, tmp_path)
        assert _slices_equal(sharded, mesh, saved) == [], f"{family} rank {r}: load_hf_checkpoint != saved slices"
