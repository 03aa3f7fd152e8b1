"""The fuzz tests' counts lines: a test appends them to ``fuzz_report``; they travel with the
test's report (``user_properties``, which pytest-xdist sends from its workers) and
``tests/conftest.py`` prints them in the terminal summary, so they show in CI output."""
from __future__ import annotations

import pytest

REPORT_KEY = "fxshard fuzz"


@pytest.fixture
def fuzz_report(request) -> list:
    """Lines the fuzz test wants in the terminal summary (appended to by the test)."""
    lines: list[str] = []
    yield lines
    request.node.user_properties.extend((REPORT_KEY, line) for line in lines)
