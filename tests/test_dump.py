"""Golden dump of one transformed Llama layer (tp=2, offline MeshSpec).

Any change in placements, local shapes or collectives shows up here in review.
Update after an intended change with::

    EXPECTTEST_ACCEPT=1 pytest tests/test_dump.py
"""
from __future__ import annotations

import expecttest

import fxshard
from fxshard import MeshSpec, Plan
from fxshard.testing.models import llama, llama_plan, tokens


def _sharded_llama():
    model = llama(seed=0, n_heads=8, n_kv_heads=4)
    return fxshard.transform(model, Plan(MeshSpec(("tp",), (2,)), llama_plan("tp")), (tokens(2, 8, 128),))


class TestDump(expecttest.TestCase):
    def test_llama_layer_tp2(self):
        # source=False: source paths differ between machines
        self.assertExpectedInline(fxshard.dump(_sharded_llama(), region="layers.0.*", source=False), """\
fxshard dump of Llama  mesh: tp=2  nodes: 56  collectives: 8 (all_reduce@tp x4, grad_sync@tp x4)
communication per step: forward 4 (16.0 KiB)  backward 4 (16.0 KiB)
   node                             op             target                                               tp    local            global           dtype      module
   layers_0_attention_norm_weight   get_attr       layers.0.attention_norm.weight                       R     [64]             [64]             float32    layers.0.attention_norm
   rms_norm                         call_function  F.rms_norm                                           R     [2, 8, 64]       [2, 8, 64]       float32    layers.0.attention_norm
   getattr_2                        call_function  builtins.getattr                                           int              (2, 8, 64)                  layers.0.attention
   getitem_2                        call_function  operator.getitem                                           int              2                           layers.0.attention
   getitem_3                        call_function  operator.getitem                                           int              8                           layers.0.attention
   layers_0_attention_wq_weight     get_attr       layers.0.attention.wq.weight                         S(0)  [32, 64]         [64, 64]         float32    layers.0.attention.wq
>> grad_sync                        call_function  fxshard.grad_sync  [fwd identity | bwd all-reduce]   R     [2, 8, 64]       [2, 8, 64]       float32    layers.0.attention.wq
   linear                           call_function  F.linear                                             S(2)  [2, 8, 32]       [2, 8, 64]       float32    layers.0.attention.wq
   layers_0_attention_wk_weight     get_attr       layers.0.attention.wk.weight                         S(0)  [16, 64]         [32, 64]         float32    layers.0.attention.wk
   linear_1                         call_function  F.linear                                             S(2)  [2, 8, 16]       [2, 8, 32]       float32    layers.0.attention.wk
   layers_0_attention_wv_weight     get_attr       layers.0.attention.wv.weight                         S(0)  [16, 64]         [32, 64]         float32    layers.0.attention.wv
   linear_2                         call_function  F.linear                                             S(2)  [2, 8, 16]       [2, 8, 32]       float32    layers.0.attention.wv
   view                             call_method    Tensor.view                                          S(2)  [2, 8, 4, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   view_1                           call_method    Tensor.view                                          S(2)  [2, 8, 2, 8]     [2, 8, 4, 8]     float32    layers.0.attention
   view_2                           call_method    Tensor.view                                          S(2)  [2, 8, 2, 8]     [2, 8, 4, 8]     float32    layers.0.attention
   float_1                          call_method    Tensor.float                                         S(2)  [2, 8, 4, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   reshape                          call_method    Tensor.reshape                                       S(2)  [2, 8, 4, 4, 2]  [2, 8, 8, 4, 2]  float32    layers.0.attention
   view_as_complex                  call_function  torch.view_as_complex                                S(2)  [2, 8, 4, 4]     [2, 8, 8, 4]     complex64  layers.0.attention
   view_3                           call_method    Tensor.view                                          R     [1, 8, 1, 4]     [1, 8, 1, 4]     complex64  layers.0.attention
   mul                              call_function  operator.mul                                         S(2)  [2, 8, 4, 4]     [2, 8, 8, 4]     complex64  layers.0.attention
   view_as_real                     call_function  torch.view_as_real                                   S(2)  [2, 8, 4, 4, 2]  [2, 8, 8, 4, 2]  float32    layers.0.attention
   flatten                          call_method    Tensor.flatten                                       S(2)  [2, 8, 4, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   type_as                          call_method    Tensor.type_as                                       S(2)  [2, 8, 4, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   float_2                          call_method    Tensor.float                                         S(2)  [2, 8, 2, 8]     [2, 8, 4, 8]     float32    layers.0.attention
   reshape_1                        call_method    Tensor.reshape                                       S(2)  [2, 8, 2, 4, 2]  [2, 8, 4, 4, 2]  float32    layers.0.attention
   view_as_complex_1                call_function  torch.view_as_complex                                S(2)  [2, 8, 2, 4]     [2, 8, 4, 4]     complex64  layers.0.attention
   view_4                           call_method    Tensor.view                                          R     [1, 8, 1, 4]     [1, 8, 1, 4]     complex64  layers.0.attention
   mul_1                            call_function  operator.mul                                         S(2)  [2, 8, 2, 4]     [2, 8, 4, 4]     complex64  layers.0.attention
   view_as_real_1                   call_function  torch.view_as_real                                   S(2)  [2, 8, 2, 4, 2]  [2, 8, 4, 4, 2]  float32    layers.0.attention
   flatten_1                        call_method    Tensor.flatten                                       S(2)  [2, 8, 2, 8]     [2, 8, 4, 8]     float32    layers.0.attention
   type_as_1                        call_method    Tensor.type_as                                       S(2)  [2, 8, 2, 8]     [2, 8, 4, 8]     float32    layers.0.attention
   repeat_interleave                call_function  torch.repeat_interleave                              S(2)  [2, 8, 4, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   repeat_interleave_1              call_function  torch.repeat_interleave                              S(2)  [2, 8, 4, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   transpose                        call_method    Tensor.transpose                                     S(1)  [2, 4, 8, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   transpose_1                      call_method    Tensor.transpose                                     S(1)  [2, 4, 8, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   transpose_2                      call_method    Tensor.transpose                                     S(1)  [2, 4, 8, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   scaled_dot_product_attention     call_function  F.scaled_dot_product_attention                       S(1)  [2, 4, 8, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   transpose_3                      call_method    Tensor.transpose                                     S(2)  [2, 8, 4, 8]     [2, 8, 8, 8]     float32    layers.0.attention
   reshape_2                        call_method    Tensor.reshape                                       S(2)  [2, 8, 32]       [2, 8, 64]       float32    layers.0.attention
   layers_0_attention_wo_weight     get_attr       layers.0.attention.wo.weight                         S(1)  [64, 32]         [64, 64]         float32    layers.0.attention.wo
   linear_3                         call_function  F.linear                                             P     [2, 8, 64]       [2, 8, 64]       float32    layers.0.attention.wo
>> all_reduce                       call_function  fxshard.all_reduce  [fwd all-reduce | bwd identity]  R     [2, 8, 64]       [2, 8, 64]       float32    layers.0.attention.wo
   add                              call_function  operator.add                                         R     [2, 8, 64]       [2, 8, 64]       float32    layers.0
   layers_0_ffn_norm_weight         get_attr       layers.0.ffn_norm.weight                             R     [64]             [64]             float32    layers.0.ffn_norm
   rms_norm_1                       call_function  F.rms_norm                                           R     [2, 8, 64]       [2, 8, 64]       float32    layers.0.ffn_norm
   layers_0_feed_forward_w1_weight  get_attr       layers.0.feed_forward.w1.weight                      S(0)  [64, 64]         [128, 64]        float32    layers.0.feed_forward.w1
>> grad_sync_1                      call_function  fxshard.grad_sync  [fwd identity | bwd all-reduce]   R     [2, 8, 64]       [2, 8, 64]       float32    layers.0.feed_forward.w1
   linear_4                         call_function  F.linear                                             S(2)  [2, 8, 64]       [2, 8, 128]      float32    layers.0.feed_forward.w1
   silu                             call_function  F.silu                                               S(2)  [2, 8, 64]       [2, 8, 128]      float32    layers.0.feed_forward
   layers_0_feed_forward_w3_weight  get_attr       layers.0.feed_forward.w3.weight                      S(0)  [64, 64]         [128, 64]        float32    layers.0.feed_forward.w3
   linear_5                         call_function  F.linear                                             S(2)  [2, 8, 64]       [2, 8, 128]      float32    layers.0.feed_forward.w3
   mul_2                            call_function  operator.mul                                         S(2)  [2, 8, 64]       [2, 8, 128]      float32    layers.0.feed_forward
   layers_0_feed_forward_w2_weight  get_attr       layers.0.feed_forward.w2.weight                      S(1)  [64, 64]         [64, 128]        float32    layers.0.feed_forward.w2
   linear_6                         call_function  F.linear                                             P     [2, 8, 64]       [2, 8, 64]       float32    layers.0.feed_forward.w2
>> all_reduce_1                     call_function  fxshard.all_reduce  [fwd all-reduce | bwd identity]  R     [2, 8, 64]       [2, 8, 64]       float32    layers.0.feed_forward.w2
   add_1                            call_function  operator.add                                         R     [2, 8, 64]       [2, 8, 64]       float32    layers.0""")
