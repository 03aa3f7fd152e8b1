"""The fuzz sweep's counts line, printed in the terminal summary (so it shows in CI
output even with output capture on)."""
from __future__ import annotations

import pytest

_REPORT = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def fuzz_report(pytestconfig) -> list:
    """Lines the fuzz tests want in the terminal summary (appended to by the tests)."""
    return pytestconfig.stash.setdefault(_REPORT, [])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.section("fxshard fuzz")
        for line in lines:
            terminalreporter.write_line(line)
