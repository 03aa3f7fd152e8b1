"""Build ``notebooks/walkthrough.ipynb`` from the cells below (stored without outputs).

The notebook is generated so that its source stays reviewable as Python and the
stored ``.ipynb`` never carries outputs.  After editing a cell here, regenerate::

    python notebooks/make_walkthrough.py

``tests/test_notebook.py`` checks that the stored notebook matches :func:`build` and
executes it.
"""
from __future__ import annotations

import os
import textwrap

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.join(HERE, "walkthrough.ipynb")

# (kind, source): "md" for markdown, "py" for code.  Every code cell asserts what it
# shows, so the notebook fails to execute when fxshard breaks.
CELLS: list[tuple[str, str]] = [
    ("md", """
    # fxshard walkthrough

    fxshard turns a single-device PyTorch model into the per-rank program of a
    tensor-parallel job by rewriting its `torch.fx` graph. You say *where tensors live*
    (a plan); fxshard checks the plan against the model, inserts every collective as an
    explicit graph node and hands back a plain `GraphModule` that trains with ordinary
    autograd.

    This notebook goes end to end on a small Llama, on CPU, in a few seconds:

    1. trace the model
    2. write a plan
    3. transform it and read the per-rank program
    4. see what a plan mistake looks like
    5. draw the graph
    6. run it on simulated ranks and compare with the single-device model
    7. read the communication summary and ask why a node has its layout
    8. switch on sequence and loss parallelism
    """),
    ("py", """
    import shutil
    from contextlib import contextmanager

    import torch
    import torch.nn.functional as F

    import fxshard
    from fxshard.testing.models import WithLoss, llama, llama_plan, tokens

    torch.set_num_threads(1)  # tiny model: threads cost more than they give
    """),
    ("md", """
    ## 1. Trace a small Llama

    `llama(n_heads=8, n_kv_heads=4)` is a 2-layer Llama (dim 64, vocab 128) with
    grouped-query attention. `fxshard.trace` is `torch.fx.symbolic_trace` plus the
    global shape of every value, recorded by running the graph on fake tensors with
    the example inputs.
    """),
    ("py", """
    model = llama(n_heads=8, n_kv_heads=4)           # deterministic weights (seed 0)
    ids = tokens(2, 8, model.args.vocab_size)       # [batch 2, seqlen 8] token ids
    gm = fxshard.trace(model, example_inputs=(ids,))

    print("\\n".join(gm.code.strip().splitlines()[:18]), "\\n    ...")
    assert "view(getitem_2, getitem_3, 8, 8)" in gm.code   # 8 heads of size 8, as written in the model
    """),
    ("md", """
    The code is the model's forward, op by op. Sizes read at run time (`tokens.shape`)
    stay symbolic (`getitem_2`, `getitem_3`); head counts are literals (`8` heads of
    size `8`). Those literals are what fxshard has to rewrite when it shards heads.

    ## 2. Write a plan

    A plan maps module name patterns (`*` matches one name) to what each module does
    with its weights. This is Megatron's tensor parallelism:

    * `colwise()` (q, k, v, w1, w3): weight split by rows (`Shard(0)`), the input
      arrives replicated, the output comes out split on its last dim (`Shard(-1)`),
      so each rank holds half of the heads;
    * `rowwise()` (o, w2): weight split by columns (`Shard(1)`), the split input gives
      a partial sum on every rank (`Partial`), and the plan asks for `Replicate`, so an
      all-reduce.

    With a `MeshSpec` (names and sizes only) everything runs offline: no process
    group, no GPU.
    """),
    ("py", """
    mesh = fxshard.MeshSpec(("tp",), (2,))
    plan = fxshard.Plan(mesh, {
        "layers.*.attention.w[qkv]": fxshard.colwise("tp"),
        "layers.*.attention.wo": fxshard.rowwise("tp"),
        "layers.*.feed_forward.w1": fxshard.colwise("tp"),
        "layers.*.feed_forward.w3": fxshard.colwise("tp"),
        "layers.*.feed_forward.w2": fxshard.rowwise("tp"),
    })
    print(plan.match("layers.1.attention.wo"))   # the entry a module gets, and what it declares
    """),
    ("md", """
    A plan is data: printable and comparable. The same plan is ready-made for the model
    zoo: `fxshard.testing.models.llama_plan("tp")` (with `sequence_parallel=`, `loss_parallel=`
    and `fused=` variants, see section 8).

    ## 3. Transform, and read the per-rank program

    `fxshard.transform` copies the model, traces it and runs its passes: layouts are
    propagated op by op, sharded sizes are made local, declared layout changes become
    collective nodes, and parameters become this rank's shards.
    """),
    ("py", """
    sharded = fxshard.transform(model, plan, example_inputs=(ids,))

    # the attention of layer 0: collectives are ordinary calls in the code
    lines = sharded.code.splitlines()
    start = next(i for i, l in enumerate(lines) if "grad_sync = " in l)
    stop = next(i for i, l in enumerate(lines) if "all_reduce = " in l)
    excerpt = [l for l in lines[start:stop + 1] if any(k in l for k in ("fxshard_", "linear", ".view("))]
    print("\\n".join(excerpt))

    # Megatron's count: one all-reduce after each row-parallel linear, 2 per layer
    assert sharded.code.count("fxshard_all_reduce(") == 2 * model.args.n_layers
    assert "view(getitem_2, getitem_3, 4, 8)" in sharded.code    # 8 heads -> 4 local heads
    # the ready-made plan gives the same program
    assert fxshard.transform(model, fxshard.Plan(mesh, llama_plan("tp")), (ids,)).code == sharded.code
    """),
    ("md", """
    * `grad_sync` is the identity forward and an all-reduce backward: the replicated
      input of a column-parallel linear gets a partial gradient on each rank, and this
      sums it (Megatron's "copy to tensor-parallel region").
    * `all_reduce` after the row-parallel `wo` sums the partial results; its backward
      is the identity.
    * the head count in `view` went from 8 to 4: each rank runs its own heads.

    `fxshard.dump` prints the same graph with each value's layout (`R` replicated,
    `S(d)` sharded on dim d, `P` partial sum), local and global shape, module and
    source line. Collective rows start with `>>` and say what they do forward and
    backward.
    """),
    ("py", """
    print(fxshard.dump(sharded, region="layers.0.*"))
    """),
    ("md", """
    ## 4. A plan mistake, and what fxshard says

    fxshard never inserts communication the plan did not ask for. When an op cannot
    run on the layout it receives, `transform` raises `fxshard.PlanError` naming the
    node, the module, the source line, the layouts and the plan change that fixes it.

    Forget to make `w2` row-parallel: its input is split on the feature dim but its
    weight is whole.
    """),
    ("py", """
    no_w2 = {k: v for k, v in llama_plan("tp").items() if not k.endswith("w2")}
    try:
        fxshard.transform(model, fxshard.Plan(mesh, no_w2), (ids,))
        raise AssertionError("expected a PlanError")
    except fxshard.PlanError as e:
        print(e)
        message = str(e)
    assert "layers.0.feed_forward.w2" in message and "rowwise('tp')" in message
    """),
    ("md", """
    Or shard 2 key/value heads over 4 ranks: each rank would get half a head, and the
    reshape into heads would split the sharded dim.
    """),
    ("py", """
    two_kv_heads = llama(n_heads=8, n_kv_heads=2)
    try:
        fxshard.transform(two_kv_heads, fxshard.Plan(fxshard.MeshSpec(("tp",), (4,)), llama_plan("tp")), (ids,))
        raise AssertionError("expected a PlanError")
    except fxshard.PlanError as e:
        print(e)
        message = str(e)
    assert "layers.0.attention" in message and "'tp'" in message
    """),
    ("md", """
    ## 5. Draw the graph

    `fxshard.to_dot` gives Graphviz source: modules as clusters, values coloured by
    layout (Replicate grey, Shard blue, Partial orange), collectives as red hexagons.
    `fxshard.render` runs Graphviz's `dot` when it is installed
    (`apt-get install graphviz`); the cell skips the picture otherwise.
    """),
    ("py", """
    from IPython.display import SVG, display

    dot_source = fxshard.to_dot(sharded, region="layers.0.feed_forward")
    print("\\n".join(dot_source.splitlines()[:6]), "\\n  ...")
    assert "all_reduce_1" in dot_source and "hexagon" in dot_source

    if shutil.which("dot"):
        svg_path = fxshard.render(sharded, "layer0.svg", region="layers.0.feed_forward")
        display(SVG(filename=svg_path))
    else:
        print("Graphviz `dot` is not installed: no picture (the DOT source above is what it would draw)")
    """),
    ("md", """
    ## 6. Run it on simulated ranks

    On a cluster, you would build a `DeviceMesh` (`init_device_mesh("cuda", (2,),
    mesh_dim_names=("tp",))`) in each process started by `torchrun` and pass it to
    `fxshard.Plan` instead of the `MeshSpec`. Here, all ranks run in this one process:
    PyTorch's fake process group plus `LocalTensorMode` make every tensor a
    `LocalTensor` holding one value per rank, and compute collectives locally.

    The reference is the single-device model, with the same weights, computed outside
    the simulation.
    """),
    ("py", """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore


    @contextmanager
    def simulated_ranks(tp):
        \"\"\"`tp` ranks in this process; yields their DeviceMesh (axis "tp").\"\"\"
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
        try:
            with LocalTensorMode(tp):
                yield init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        finally:
            dist.destroy_process_group()


    def per_rank(t):
        \"\"\"The per-rank values of a LocalTensor, by rank.\"\"\"
        return dict(sorted(t._local_tensors.items()))


    # single-device reference: output, loss, and the gradient of one sharded weight
    targets = tokens(2, 8, model.args.vocab_size, seed=1)
    reference = llama(n_heads=8, n_kv_heads=4)       # same seed, same weights as `model`
    ref_logits = reference(ids)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    ref_w1_grad = reference.layers[0].feed_forward.w1.weight.grad     # [128, 64]
    """),
    ("py", """
    TP = 2
    with simulated_ranks(TP) as device_mesh:
        tp_model = fxshard.transform(model, fxshard.Plan(device_mesh, llama_plan("tp")), (ids,))
        logits = tp_model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        w1 = tp_model.get_parameter("layers.0.feed_forward.w1.weight")   # same name as in the model
        logits_r, loss_r, w1_grad_r = per_rank(logits), per_rank(loss), per_rank(w1.grad)

    assert tp_model.code == sharded.code      # the same program as offline, the same on every rank
    rows = ref_w1_grad.shape[0] // TP         # w1 is Shard(0): rank r holds rows [r*rows, (r+1)*rows)
    for r in range(TP):
        torch.testing.assert_close(logits_r[r], ref_logits)
        torch.testing.assert_close(loss_r[r], ref_loss)
        torch.testing.assert_close(w1_grad_r[r], ref_w1_grad[r * rows:(r + 1) * rows])
        print(f"rank {r}: w1 shard {tuple(w1_grad_r[r].shape)}  loss {loss_r[r].item():.6f} (1 device {ref_loss.item():.6f})  "
              f"max |logits diff| {(logits_r[r] - ref_logits).abs().max().item():.1e}  "
              f"max |w1 grad diff| {(w1_grad_r[r] - ref_w1_grad[r * rows:(r + 1) * rows]).abs().max().item():.1e}")
    """),
    ("md", """
    Every rank computes the full logits (the plan leaves the LM head replicated), the
    same loss as one device, and exactly its slice of each sharded weight's gradient:
    ordinary autograd through fxshard's collectives gives Megatron's gradients.

    With real processes the code is the same; `python -m fxshard demo` spawns 2 gloo
    ranks and trains this model for a few SGD steps next to the single-device one.

    ## 7. What does it communicate, and why?

    `fxshard.comm_summary` lists every collective of one training step, forward and
    backward (the backward ones come from each collective's autograd rule), with its
    size for the example shapes. No process group needed.
    """),
    ("py", """
    summary = fxshard.comm_summary(sharded)
    print(summary)

    n_layers = model.args.n_layers
    assert summary.count("forward", "all_reduce") == 2 * n_layers      # after wo and w2
    assert summary.count("backward", "all_reduce") == 2 * n_layers     # the grad syncs before wq/wk/wv and w1/w3
    activation_bytes = ids.numel() * model.args.dim * 4                # [2, 8, 64] float32
    assert summary.nbytes("forward") == 2 * n_layers * activation_bytes
    """),
    ("md", """
    `fxshard.explain` answers "why does this node have this layout?": the chain of
    layout rules back to what the plan declared. `linear_6` is layer 0's `w2`: a
    partial sum, because its input is split on the feature dim by the column-parallel
    `w1`/`w3` and its weight by the row-parallel plan entry.
    """),
    ("py", """
    why = fxshard.explain(sharded, "linear_6")
    print(why)
    assert "tp=P because" in why and "plan entry 'layers.*.feed_forward.w2'" in why
    """),
    ("md", """
    ## 8. Sequence parallelism and loss parallelism

    Two more options of the ready-made plan: `sequence_parallel=True` keeps the
    residual stream split along the sequence between blocks (norms run on shards,
    each block all-gathers its input once and reduce-scatters its output);
    `loss_parallel=True` keeps the logits split along the vocabulary and computes the
    cross-entropy without ever gathering them. The loss is part of the model, so wrap
    it in `WithLoss` (its submodules gain a `model.` prefix).
    """),
    ("py", """
    sp_plan = {"model." + k: v for k, v in llama_plan("tp", sequence_parallel=True, loss_parallel=True).items()}
    with_loss = WithLoss(model)

    sp_summary = fxshard.comm_summary(fxshard.transform(with_loss, fxshard.Plan(mesh, sp_plan), (ids, targets)))
    print(sp_summary)

    # Megatron-SP: per layer 2 all-gathers + 2 reduce-scatters replace the 2 all-reduces;
    # +1 each for the vocab-parallel embedding (reduce-scatter) and the LM head (all-gather)
    assert sp_summary.count("forward", "all_gather") == sp_summary.count("forward", "reduce_scatter") == 2 * n_layers + 1
    # loss parallel: the only all-reduces left carry one number per token, never the logits
    assert sp_summary.nbytes("forward", "all_reduce") == 3 * ids.numel() * 4
    """),
    ("md", """
    On simulated ranks, the loss equals the single-device loss, and so does the
    gradient of a norm weight (replicated, applied to sequence shards: its gradient
    is summed over ranks by a `grad_sync`).
    """),
    ("py", """
    with simulated_ranks(TP) as device_mesh:
        sp_model = fxshard.transform(with_loss, fxshard.Plan(device_mesh, sp_plan), (ids, targets))
        sp_loss = sp_model(ids, targets)
        sp_loss.backward()
        norm_grad_r = per_rank(sp_model.get_parameter("model.layers.0.attention_norm.weight").grad)
        sp_loss_r = per_rank(sp_loss)

    ref_norm_grad = reference.layers[0].attention_norm.weight.grad
    for r in range(TP):
        torch.testing.assert_close(sp_loss_r[r], ref_loss)
        torch.testing.assert_close(norm_grad_r[r], ref_norm_grad)
        print(f"rank {r}: loss {sp_loss_r[r].item():.6f} (1 device {ref_loss.item():.6f})  "
              f"max |norm grad diff| {(norm_grad_r[r] - ref_norm_grad).abs().max().item():.1e}")
    """),
    ("md", """
    ## Where next

    * `docs/plans.md`: the plan presets, `Plan.from_torch` for plans written for
      `parallelize_module`; `docs/big-models.md`: checkpoints (`fxshard.full_state_dict`);
      `docs/performance.md`: `torch.compile`; `docs/training.md`: a training run.
    * `python -m fxshard dump 'fxshard.testing.models:llama(n_heads=8,n_kv_heads=4)' --plan fxshard.testing.models:llama_plan --mesh tp=4`:
      the dump from the command line.
    * `python -m fxshard demo`: the same model on 2 real gloo processes.
    """),
]


def _source(text: str) -> str:
    return textwrap.dedent(text).strip("\n")


def build() -> nbformat.NotebookNode:
    """The walkthrough notebook, without outputs, with stable cell ids."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    }
    for i, (kind, text) in enumerate(CELLS):
        make = nbformat.v4.new_markdown_cell if kind == "md" else nbformat.v4.new_code_cell
        nb.cells.append(make(_source(text), id=f"cell-{i:02d}"))
    nbformat.validate(nb)
    return nb


if __name__ == "__main__":
    nbformat.write(build(), NOTEBOOK)
    print(f"wrote {os.path.relpath(NOTEBOOK)}")
