"""``ModuleSpec(local=True, compute=fn)``: ``fn(module, *forward_args)`` is checked
against the module's forward when the model is transformed; each broken rule is a
TypeError naming the parameter."""
import re

import pytest
import torch
from torch import nn

import fxshard
from fxshard import MeshSpec, ModuleSpec, Plan
from fxshard.runtime.moe import check_compute_signature


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x, mask, scale=1.0, *, bias=None):
        return x * self.w * scale + mask


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, mask):
        return self.block(x, mask) + 1


def _transform(fn):
    spec = ModuleSpec(local=True, compute=fn, out_src={})
    x, mask = torch.randn(2, 4), torch.randn(2, 4)
    return fxshard.transform(Net(), Plan(MeshSpec(("dp",), (2,)), {"block": spec}), (x, mask)), (x, mask)


def star_args(block, x, *rest):
    return x


def star_kwargs(block, x, mask, **options):
    return x


def unknown_name(block, x, mask, temperature):
    return x


def out_of_order(block, mask, x):
    return x


def keyword_only_in_forward(block, x, mask, bias):
    return x


def missing_required(block, x):
    return x


@pytest.mark.parametrize("fn, parameter", [
    (star_args, "'*rest'"),
    (star_kwargs, "'**options'"),
    (unknown_name, "'temperature'"),
    (out_of_order, "'x'"),
    (keyword_only_in_forward, "'bias'"),
    (missing_required, "'mask'"),
], ids=["*args", "**kwargs", "unknown name", "out of order", "keyword-only in forward", "missing required"])
def test_each_rule_is_a_type_error_naming_the_parameter(fn, parameter):
    with pytest.raises(TypeError, match=re.escape(parameter)) as err:
        _transform(fn)
    assert "'block'" in str(err.value) and fn.__name__ in str(err.value)


def subset(block, x, mask):
    return x * block.w * 3 + mask


def with_optional(block, x, mask, scale=5.0, *, bias=None):
    return x * block.w * scale + mask


def test_valid_signatures_pass_and_replace_the_forward():
    check_compute_signature(Block(), subset)
    check_compute_signature(Block(), with_optional)
    sharded, (x, mask) = _transform(subset)
    torch.testing.assert_close(sharded(x, mask), x * 2.0 * 3 + mask + 1)
    # the forward's default (scale=1.0) fills a parameter the call leaves out
    sharded, (x, mask) = _transform(with_optional)
    torch.testing.assert_close(sharded(x, mask), x * 2.0 * 1.0 + mask + 1)


class PassesScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x, mask):
        return self.block(x, mask, 3.0)


def test_an_argument_the_call_passes_must_be_accepted():
    spec = ModuleSpec(local=True, compute=subset, out_src={})
    with pytest.raises(TypeError, match="passes 'scale'"):
        fxshard.transform(PassesScale(), Plan(MeshSpec(("dp",), (2,)), {"block": spec}), (torch.randn(2, 4), torch.randn(2, 4)))


def test_first_parameter_is_the_module():
    def no_params():
        return None

    with pytest.raises(TypeError, match="first parameter must be the module"):
        check_compute_signature(Block(), no_params)
