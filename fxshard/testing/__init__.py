"""Test and demo models and benchmark harnesses, kept apart from the library's core.

* :mod:`fxshard.testing.models`: fxshard's own Llama / GPT-2 / MLP zoo and their plans
  (``llama_plan``, ``gpt2_plan``), written to be ``torch.fx``-traceable.
* :mod:`fxshard.testing.moe_models`: Mixtral-style MoE blocks and the MoE demo.
* :mod:`fxshard.testing.nanogpt`: a nanoGPT-style GPT-2 (Karpathy's structure).
* :mod:`fxshard.testing.hf_tiny`: tiny configs of every HF decoder family with a TP plan.
* :mod:`fxshard.testing.torchtitan_models`: a small torchtitan Llama3.
* :mod:`fxshard.testing.bench` (its contenders in :mod:`fxshard.testing.bench_contenders`): the
  step-time harness behind ``benchmarks/step_time.py`` and ``python -m fxshard demo --bench``.
* :mod:`fxshard.testing.launch`: one function run on every rank (gloo processes, or torchrun's).

The core (plan, passes, runtime, capture) never imports them (docs/design.md, the layers); the
trainer builds random-weight models of an HF type from ``hf_tiny``; the demo and the CLI use
the rest.
"""
