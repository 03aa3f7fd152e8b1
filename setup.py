"""The package list, found rather than written by hand (a hand-written list once left out
``fxshard.layout.op_rules`` and the built wheel failed at import).  Everything else lives in
``pyproject.toml``.  ``passes/`` at the top of the repository installs as the subpackage
``fxshard.passes``, never as a top-level ``passes``."""
from setuptools import find_packages, setup

packages = find_packages(include=["fxshard", "fxshard.*"])
packages += ["fxshard.passes"] + [f"fxshard.passes.{p}" for p in find_packages("passes")]
setup(packages=packages, package_dir={"fxshard.passes": "passes"})
