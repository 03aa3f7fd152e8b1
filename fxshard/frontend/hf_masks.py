"""HF transformers' attention masks under context parallelism.

transformers 5.x builds every causal mask from positions: under ``torch.export`` it
never takes its ``is_causal`` shortcut, and it looks for packed sequences with a
``cumsum`` over the position ids.  Both need the whole sequence on every rank, which
a context-parallel sequence is not (fxshard refuses the graph, naming the
``cumsum``).  When the caller passes neither ``attention_mask`` nor ``position_ids``,
the positions are the model's own ``arange`` (nothing packed, nothing padded), and
the plain causal mask is exactly SDPA's ``is_causal=True``.  While such a model is
captured for a plan with context-parallel modules, :func:`causal_attention_as_sdpa_flag`
lets transformers see that: no packed-sequence search, the SDPA mask of a plain causal
layer is None, and that of a sliding-window layer one ``fxshard::sliding_window_mask``
node, whose rows each rank builds for its own positions.  Other patterns (chunked
attention, overlays) keep transformers' own masks, and are refused under context
parallelism: they are built over the local sequence.
"""
from __future__ import annotations

import contextlib

from fxshard.errors import PlanError


def _is_hf(model) -> bool:
    return type(model).__module__.startswith("transformers.") and hasattr(getattr(model, "config", None), "_attn_implementation")


@contextlib.contextmanager
def causal_attention_as_sdpa_flag(model, plan, kwargs):
    """Capture-time patch of transformers' mask builders (see the module docstring);
    a no-op unless ``plan`` has context-parallel modules and ``model`` is an HF model."""
    if plan is None or not plan.context_parallel_axes() or not _is_hf(model):
        yield
        return
    given = [k for k in ("attention_mask", "position_ids") if kwargs.get(k) is not None]
    if given:
        raise PlanError(f"context parallelism on {type(model).__name__}: the example inputs pass {given}, from which "
                        f"transformers builds its mask over the local part of the sequence only\n  fix: pass only "
                        f"input_ids (and labels); padding and packed sequences under context parallelism are not supported yet")
    impl = model.config._attn_implementation
    if impl != "sdpa":
        raise PlanError(f"context parallelism on {type(model).__name__}: its attention is {impl!r}, which fxshard cannot "
                        f"rewrite\n  fix: build the model with attn_implementation='sdpa'")
    import transformers.masking_utils as mu

    original_sdpa_mask = mu.AttentionMaskInterface._global_mapping["sdpa"]
    original_packed = mu.find_packed_sequence_indices

    def sdpa_mask(*args, mask_function=None, attention_mask=None, **kw):
        if attention_mask is None and mask_function is mu.causal_mask_function:
            return None  # sdpa_attention_forward then calls SDPA with is_causal=True
        window = kw.get("local_size")
        if attention_mask is None and window is not None and _is_sliding_window(mask_function, window):
            from fxshard.runtime.context_parallel_ops import sliding_window_mask

            return sliding_window_mask(kw["q_length"], int(window), kw["device"])
        return original_sdpa_mask(*args, mask_function=mask_function, attention_mask=attention_mask, **kw)

    mu.AttentionMaskInterface._global_mapping["sdpa"] = sdpa_mask
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.AttentionMaskInterface._global_mapping["sdpa"] = original_sdpa_mask
        mu.find_packed_sequence_indices = original_packed


def _is_sliding_window(mask_function, window: int) -> bool:
    """Is transformers' index-based ``mask_function`` exactly causal attention within
    ``window`` (``q - window < k <= q``)?  Checked on a grid of ``2 window + 3`` positions, so
    that any other pattern (chunked, bidirectional, an overlay) keeps transformers' own mask.

    The grid is one broadcast call (transformers' mask functions are elementwise index
    arithmetic) on real tensors, outside the capture's fake and proxy modes.  Checked point
    by point under them, as before, a window of 512 cost a million traced scalar ops per
    sliding-window layer: Gemma3 under context parallelism spent minutes and gigabytes
    in capture (issue 42)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    n = 2 * int(window) + 3
    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch._C.DisableTorchFunction():
        q = torch.arange(n).view(n, 1)
        k = torch.arange(n).view(1, n)
        zero = torch.zeros((), dtype=torch.long)
        try:
            got = torch.as_tensor(mask_function(zero, zero, q, k))
        except Exception:  # a mask function reading per-batch data (padding, packed ids): not this pattern
            return False
        want = (q - window < k) & (k <= q)
        return got.dtype == torch.bool and got.shape in ((n, n), (1, n, n), (1, 1, n, n)) and bool(
            torch.equal(got.reshape(n, n), want))


def causal_mask_hint(model, plan) -> str:
    """What to add to a capture failure while the masks were patched: a model that reads
    its causal mask itself (an indexer, a custom attention) fails on the None."""
    if plan is None or not plan.context_parallel_axes() or not _is_hf(model):
        return ""
    return ("\n  note: under context parallelism transformers builds no causal mask while fxshard captures (SDPA takes "
            "is_causal=True); this model reads the mask itself, which context parallelism does not support yet")
