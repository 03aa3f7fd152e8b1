"""transformers' masks under context parallelism (``fxshard/frontend/hf_masks.py``): a
sliding-window layer's mask becomes one ``fxshard::sliding_window_mask`` node, and telling
that pattern apart costs the same whatever the window (it once cost a traced scalar op per
grid point: Gemma3's window of 512 took minutes of capture under cp)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")
import transformers.masking_utils as mu  # noqa: E402

from fxshard.frontend.hf_masks import causal_attention_as_sdpa_flag  # noqa: E402
from fxshard.plan.mesh import MeshSpec  # noqa: E402
from fxshard.plan.plan import Plan  # noqa: E402
from fxshard.plan.specs import context_parallel  # noqa: E402
from fxshard.testing.hf_tiny import tiny_config  # noqa: E402


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def patched_sdpa_mask(window: int, mask_function, length: int = 16):
    cfg = tiny_config("gemma3_text")
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    plan = Plan(MeshSpec(("cp",), (2,)), {"model.layers.*.self_attn": context_parallel("cp")})
    counter = CountOps()
    with causal_attention_as_sdpa_flag(model, plan, {}):
        with counter:
            mask = mu.AttentionMaskInterface._global_mapping["sdpa"](
                batch_size=1, q_length=length, kv_length=length, mask_function=mask_function, local_size=window,
                device=torch.device("cpu"))
    return mask, counter.ops


@pytest.mark.parametrize("window", [4, 512, 4096])
def test_sliding_window_is_one_mask_node_at_a_cost_independent_of_the_window(window):
    mask, ops = patched_sdpa_mask(window, mu.sliding_window_causal_mask_function(window))
    q, k = torch.arange(16)[:, None], torch.arange(16)[None, :]
    assert torch.equal(mask, (k <= q) & (k > q - window))
    assert ops < 20, f"the window check dispatched {ops} ops under the capture's modes (window {window})"


def test_other_patterns_keep_transformers_mask():
    chunked = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    mask, _ = patched_sdpa_mask(4, chunked)
    q, k = torch.arange(16)[:, None], torch.arange(16)[None, :]
    assert torch.equal(mask.reshape(16, 16), (k <= q) & (k // 4 == q // 4))
