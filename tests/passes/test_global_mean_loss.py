"""passes/global_mean_loss.py: a mean loss over tokens sharded on a context-parallel axis."""
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.meta import KEY
from fxshard.testing.models import WithLoss, llama, tokens


def test_cross_entropy_becomes_the_global_mean():
    plan = Plan(MeshSpec(("cp",), (2,)), {"model.layers.*.attention": fxshard.context_parallel()},
                inputs={"tokens": {"cp": Shard(1)}, "targets": {"cp": Shard(1)}})
    gm = fxshard.transform(WithLoss(llama()), plan, (tokens(1, 16, 128), tokens(1, 16, 128, seed=1)))
    (loss,) = [n for n in gm.graph.nodes if n.target is fxshard.global_mean_cross_entropy]
    assert loss.args[2] == ("cp",) and loss.kwargs == {"ignore_index": -100}
    assert loss.meta[KEY].value.layout == {"cp": Replicate()}


def test_sum_is_left_alone():
    plan = Plan(MeshSpec(("cp",), (2,)), {"model.layers.*.attention": fxshard.context_parallel()},
                inputs={"tokens": {"cp": Shard(1)}, "targets": {"cp": Shard(1)}})
    gm = fxshard.transform(WithLoss(llama(), reduction="sum"), plan, (tokens(1, 16, 128), tokens(1, 16, 128, seed=1)))
    assert "global_mean" not in gm.code
