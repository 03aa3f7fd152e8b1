"""The importers of other libraries' plans, which ``Plan.from_hf`` / ``from_torch`` /
``from_torchtitan`` call: ``hf_plan`` (HF's ``base_model_tp_plan`` / ``base_model_ep_plan``
strings), ``torch_plan`` (torch's ``ParallelStyle`` objects), ``torchtitan_plan`` (what
torchtitan's parallelize functions apply).  Each converts into the vocabulary of
``fxshard.plan.specs``; HF's MoE plans name the runtime's routed experts, so they sit above
the runtime, with ``fxshard.plan.plan``.

Example::

    from fxshard.plan.importers.hf_plan import specs_from_hf
    specs = specs_from_hf(mesh, model)          # the entries Plan.from_hf(mesh, model) holds
"""
