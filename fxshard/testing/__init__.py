"""Test and demo models and benchmark harnesses, kept apart from the library's core.

* :mod:`fxshard.testing.models`: fxshard's own Llama / GPT-2 / MLP zoo and their plans
  (``llama_plan``, ``gpt2_plan``), written to be ``torch.fx``-traceable.
* :mod:`fxshard.testing.moe_models`: Mixtral-style MoE blocks and the MoE demo.
* :mod:`fxshard.testing.nanogpt`: a nanoGPT-style GPT-2 (Karpathy's structure).
* :mod:`fxshard.testing.hf_tiny`: tiny configs of every HF decoder family with a TP plan.
* :mod:`fxshard.testing.torchtitan_models`: a small torchtitan Llama3.
* :mod:`fxshard.testing.third_party`: litgpt, torchtune and transformers models with their
  plans (the library's own or ``auto_plan``'s), the cases of the third-party conformance sweep.
* :mod:`fxshard.testing.bench`: the step-time harness behind ``benchmarks/step_time.py``
  and ``python -m fxshard demo --bench``.

The core (plan, passes, runtime, capture) never imports them; the demo and the CLI do, lazily.
"""
