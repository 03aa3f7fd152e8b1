"""propagate: every value gets its layout, global and local shape; layouts change
only at declared boundaries; rewrites are flagged for the specialized passes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard

from fxshard import MeshSpec, Plan, rowwise, vocab_parallel
from fxshard.boundary import region_output
from fxshard.meta import KEY, SizeInfo, TensorInfo
from fxshard.models import llama, llama_plan, mlp, tokens

IDS = tokens(2, 8, 128)
R = Replicate()


def _value(gm, pred, i=0):
    return [n for n in gm.graph.nodes if pred(n)][i].meta[KEY]


def test_llama_attention_layouts(after_pass):
    gm = after_pass("propagate", llama(n_heads=8, n_kv_heads=4), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    is_ = lambda target: (lambda n: n.target is target)
    q = _value(gm, is_(F.linear)).value
    assert q == TensorInfo({"tp": Shard(2)}, (2, 8, 64), (2, 8, 32), torch.float32, True)
    k = _value(gm, is_(F.linear), 1).value
    assert k.local_shape == (2, 8, 16) and k.shape == (2, 8, 32)
    view_q = _value(gm, lambda n: n.op == "call_method" and n.target == "view").value
    assert view_q.layout == {"tp": Shard(2)} and view_q.local_shape == (2, 8, 4, 8)  # 8 heads -> 4 per rank
    sdpa = _value(gm, is_(F.scaled_dot_product_attention)).value
    assert sdpa.layout == {"tp": Shard(1)} and sdpa.local_shape == (2, 4, 8, 8)
    wo = _value(gm, is_(F.linear), 3)
    assert wo.value.layout == {"tp": Partial()} and wo.rule == "linear"
    out = _value(gm, lambda n: n.target is region_output and n.args[1] == "layers.0.attention.wo")
    assert out.redistribute == ({"tp": Partial()}, {"tp": R}) and out.value.layout == {"tp": R}
    logits = _value(gm, is_(F.linear), -1).value
    assert logits.layout == {"tp": R} and logits.local_shape == logits.shape == (2, 8, 128)


def test_sizes_read_at_run_time(after_pass):
    gm = after_pass("propagate", llama(), Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (IDS,))
    import operator
    sizes = [n.meta[KEY].value for n in gm.graph.nodes if n.target is operator.getitem and isinstance(n.meta[KEY].value, SizeInfo)]
    assert SizeInfo(2, frozenset()) in sizes and SizeInfo(8, frozenset()) in sizes


def test_batch_sharding_flows_through(after_pass):
    plan = Plan(MeshSpec(("dp", "tp"), (2, 2)), llama_plan("tp"), inputs={"tokens": {"dp": Shard(0)}})
    gm = after_pass("propagate", llama(), plan, (tokens(4, 8, 128),))
    emb = _value(gm, lambda n: n.target is F.embedding).value
    assert emb.layout == {"dp": Shard(0), "tp": R} and emb.local_shape == (2, 8, 64)
    q = _value(gm, lambda n: n.target is F.linear).value
    assert q.layout == {"dp": Shard(0), "tp": Shard(2)} and q.local_shape == (2, 8, 32)


def test_propagate_adds_no_communication(before_pass, after_pass):
    plan = Plan(MeshSpec(("tp",), (2,)), llama_plan("tp"))
    model = llama()
    assert before_pass("propagate", model, plan, (IDS,)).code == after_pass("propagate", model, plan, (IDS,)).code


def test_rewrites_are_flagged(after_pass):
    x = torch.randn(2, 4, 32)
    gm = after_pass("propagate", mlp(), Plan(MeshSpec(("tp",), (2,)), {"fc2": rowwise(inputs=Replicate())}), (x,))
    assert [n.meta[KEY].rewrite for n in gm.graph.nodes if n.target is F.linear] == [None, "defer_bias"]
    plan = Plan(MeshSpec(("tp",), (2,)), {"tok_embeddings": vocab_parallel()})
    gm = after_pass("propagate", llama(), plan, (IDS,))
    emb = _value(gm, lambda n: n.target is F.embedding)
    assert emb.rewrite == "vocab_parallel_embedding" and emb.value.layout == {"tp": Partial()}
