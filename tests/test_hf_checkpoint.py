"""fxshard.load_hf_checkpoint: an HF checkpoint (save_pretrained, sharded into several
safetensors files) read into a model transformed on the meta device, each rank reading
only its slices.  Offline ranks (MeshSpec coordinates) check every local tensor; real
gloo ranks check the logits against the unsharded model."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fxshard  # noqa: E402
from fxshard import MeshSpec, Plan  # noqa: E402
from fxshard.testing.hf_tiny import tiny_config  # noqa: E402

from equivalence import expected_local  # noqa: E402
from harness import make_mesh, spawn  # noqa: E402

IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _build(cfg, device=None, dtype=torch.float32, seed=0):
    from transformers import AutoModelForCausalLM

    if device == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def _save(model, path):
    model.save_pretrained(path, max_shard_size="40KB")  # several files and an index
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) > 1 and (path / "model.safetensors.index.json").exists(), files
    return path


class _CountReads:
    """safetensors' ``safe_open`` whose slice reads count the elements they return."""

    def __init__(self, real):
        self.real, self.elements = real, 0

    def __call__(self, *a, **k):
        outer = self

        class Opened:
            def __init__(self):
                self.f = outer.real(*a, **k)

            def __enter__(self):
                self.inner = self.f.__enter__()
                return self

            def __exit__(self, *exc):
                return self.f.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_slice(self, name):
                piece = self.inner.get_slice(name)

                class Sliced:
                    def get_shape(self):
                        return piece.get_shape()

                    def get_dtype(self):
                        return piece.get_dtype()

                    def __getitem__(self, index):
                        t = piece[index]
                        outer.elements += t.numel()
                        return t
                return Sliced()
        return Opened()


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("gpt2", torch.float32), ("phi3", torch.float32),
                                          ("qwen3", torch.bfloat16)])
def test_each_rank_reads_its_slices(family, dtype, tmp_path, monkeypatch):
    """tp=2: every local tensor is the slice of the checkpoint's (converted to the model's
    dtype); fused parts (Phi-3 qkv_proj, gate_up_proj) and GPT-2's tied wte/lm_head
    included; a rank reads only as many elements as it holds."""
    import safetensors

    cfg = tiny_config(family)
    single = _build(cfg)
    path = _save(single, tmp_path / family)
    full = single.state_dict()
    meta = _build(cfg, "meta", dtype)
    counter = _CountReads(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", counter)
    for r in range(2):
        mesh = MeshSpec(("tp",), (2,), coordinate=(r,))
        sharded = fxshard.transform(meta, Plan.from_hf(mesh, meta), example_kwargs={"input_ids": IDS})
        fxshard.materialize(sharded, meta, init=None)
        counter.elements = 0
        fxshard.load_hf_checkpoint(sharded, path)
        held = 0
        for fqn, t in sharded.state_dict().items():
            if fqn not in full:
                continue
            assert t.dtype == dtype
            assert torch.equal(t, expected_local(sharded, mesh, full[fqn], fqn).to(dtype)), f"{family} rank {r}: {fqn}"
        held = sum(t.numel() for t in {id(t): t for t in sharded.state_dict().values()}.values()
                   if t.dtype == dtype)
        assert counter.elements <= held, f"rank {r} read {counter.elements} elements, holds {held}"
        assert counter.elements > 0.9 * held


def test_wrong_checkpoint_and_order_are_plan_errors(tmp_path):
    cfg = tiny_config("llama")
    path = _save(_build(cfg), tmp_path / "llama")
    meta = _build(cfg, "meta")
    mesh = MeshSpec(("tp",), (2,))
    sharded = fxshard.transform(meta, Plan.from_hf(mesh, meta), example_kwargs={"input_ids": IDS})
    with pytest.raises(fxshard.PlanError, match="meta device.*materialize"):
        fxshard.load_hf_checkpoint(sharded, path)
    fxshard.materialize(sharded, meta, init=None)
    other = tiny_config("llama", intermediate_size=256)
    with pytest.raises(fxshard.PlanError, match="mlp.*shape.*this config"):
        fxshard.load_hf_checkpoint(sharded, _save(_build(other), tmp_path / "other"))
    with pytest.raises(fxshard.PlanError, match="nowhere"):
        fxshard.load_hf_checkpoint(sharded, tmp_path / "nowhere")
    # a checkpoint lacking tensors: strict names them, strict=False keeps the rest
    from safetensors.torch import save_file

    partial = {k: v for k, v in _build(cfg).state_dict().items() if "layers.1" not in k}
    (tmp_path / "partial").mkdir()
    save_file({k: v.contiguous() for k, v in partial.items() if k != "lm_head.weight"}, tmp_path / "partial" / "model.safetensors")
    with pytest.raises(fxshard.PlanError, match="lacks.*layers.1"):
        fxshard.load_hf_checkpoint(sharded, tmp_path / "partial")
    fxshard.load_hf_checkpoint(sharded, tmp_path / "partial", strict=False)


def _logits_match(rank, world_size, path, cfg, tp):
    mesh = make_mesh({"tp": tp})
    meta = _build(cfg, "meta")
    sharded = fxshard.transform(meta, Plan.from_hf(mesh, meta), example_kwargs={"input_ids": IDS})
    fxshard.materialize(sharded, meta, init=None)
    fxshard.load_hf_checkpoint(sharded, path)
    single = _build(cfg)
    single.load_state_dict(torch.load(f"{path}/state.pt"))
    with torch.no_grad():
        want = single(input_ids=IDS).logits
        got = sharded(input_ids=IDS).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tp", [2, 4])
def test_loaded_model_gives_the_unsharded_logits(tp, tmp_path):
    cfg = tiny_config("llama", num_key_value_heads=4)
    single = _build(cfg, seed=3)
    path = _save(single, tmp_path / "llama")
    torch.save(single.state_dict(), path / "state.pt")
    spawn(_logits_match, tp, str(path), cfg, tp)


def _attention_plan(mesh):
    """Megatron attention; the experts stay whole on every rank (expert parallelism of
    HF's fused experts is issue 11's)."""
    from fxshard import colwise, rowwise

    attn = "model.layers.*.self_attn."
    return Plan(mesh, {attn + "q_proj": colwise(), attn + "k_proj": colwise(), attn + "v_proj": colwise(),
                       attn + "o_proj": rowwise()})


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_moe_checkpoint_experts_are_stacked_from_per_expert_tensors(family, tmp_path):
    """HF saves MoE experts one by one (``experts.3.w1.weight``) and stacks them on load
    into ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj``, by its own conversion table.
    load_hf_checkpoint follows that table, reading box by box."""
    cfg = tiny_config(family)
    single = _build(cfg)
    path = _save(single, tmp_path / family)
    from fxshard.state.hf_checkpoint import checkpoint_files

    assert any(".experts.0." in k for k in checkpoint_files(path)), "the checkpoint keeps per-expert tensors"
    full = single.state_dict()
    meta = _build(cfg, "meta")
    for r in range(2):
        mesh = MeshSpec(("tp",), (2,), coordinate=(r,))
        sharded = fxshard.transform(meta, _attention_plan(mesh), example_kwargs={"input_ids": IDS})
        fxshard.materialize(sharded, meta, init=None)
        fxshard.load_hf_checkpoint(sharded, path)
        for fqn, t in sharded.state_dict().items():
            assert torch.equal(t, expected_local(sharded, mesh, full[fqn], fqn)), f"{family} rank {r}: {fqn}"


def test_stacked_sources_read_only_their_box(tmp_path):
    """A box of gate_up_proj (experts 1..2, rows across the gate/up seam) reads just its
    elements from the per-expert tensors: what a rank holding a shard of it reads."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from fxshard.state.hf_checkpoint import Concatenated, Leaf, Stacked, read_box

    g = torch.Generator().manual_seed(0)
    w1 = [torch.randn(6, 4, generator=g) for _ in range(3)]
    w3 = [torch.randn(6, 4, generator=g) for _ in range(3)]
    tensors = {f"e{i}.w1": w1[i] for i in range(3)} | {f"e{i}.w3": w3[i] for i in range(3)}
    f = tmp_path / "moe.safetensors"
    save_file(tensors, f)
    source = Concatenated(1, [Stacked(0, [Leaf(f"e{i}.w1", f, (6, 4)) for i in range(3)]),
                              Stacked(0, [Leaf(f"e{i}.w3", f, (6, 4)) for i in range(3)])])
    whole = torch.cat([torch.stack(w1), torch.stack(w3)], 1)  # what HF's conversion makes
    assert source.shape == tuple(whole.shape) == (3, 12, 4)
    read = []
    with safe_open(f, framework="pt") as st:
        class Counting:
            def get_slice(self, name):
                piece = st.get_slice(name)

                class S:
                    def __getitem__(self, box):
                        out = piece[box]
                        read.append(out.numel())
                        return out
                return S()
        box = (slice(1, 3), slice(4, 9), slice(1, 4))
        got = read_box(source, box, lambda _: Counting())
    assert torch.equal(got, whole[box])
    assert sum(read) == got.numel()
