"""Test configuration.

* ``tests/`` is importable (``from harness import ...``, ``from equivalence import
  ...``) from every test directory, also in spawned ranks.
* The fuzz tests' counts lines (``tests/fuzz/conftest.py``) are printed in the terminal
  summary, also from pytest-xdist workers (this conftest is the one the controller loads).
* Fixtures ``after_pass`` / ``before_pass``: the graph right after (or right before)
  one pass of ``fxshard.transform``, running the real pipeline in its real order::

      def test_it(after_pass):
          gm = after_pass("propagate", model, plan, (ids,))
"""
from __future__ import annotations

import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


def _stop_at(name: str, model, plan, example_inputs, run_it: bool):
    """The graph of ``fxshard.transform`` right after pass ``name`` (``run_it``) or right
    before it, by the pipeline's own ``stop_after=``."""
    import fxshard
    from fxshard.transform import PASS_NAMES

    assert name in PASS_NAMES, f"no pass {name!r} in fxshard.transform's PIPELINE: {PASS_NAMES}"
    i = PASS_NAMES.index(name) + (0 if run_it else -1)
    assert i >= 0, f"nothing runs before the first pass {name!r}"
    return fxshard.transform(model, plan, example_inputs=example_inputs, stop_after=PASS_NAMES[i])


@pytest.fixture
def after_pass():
    """``after_pass(name, model, plan, example_inputs)`` -> the GraphModule right after pass ``name``."""
    return lambda name, model, plan, example_inputs: _stop_at(name, model, plan, example_inputs, True)


@pytest.fixture
def before_pass():
    """``before_pass(name, model, plan, example_inputs)`` -> the GraphModule right before pass ``name``."""
    return lambda name, model, plan, example_inputs: _stop_at(name, model, plan, example_inputs, False)


_FUZZ_LINES: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        _FUZZ_LINES.extend(line for key, line in report.user_properties if key == "fxshard fuzz")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _FUZZ_LINES:
        terminalreporter.section("fxshard fuzz")
        for line in _FUZZ_LINES:
            terminalreporter.write_line(line)
