"""The public surface: every name in ``__all__`` resolves, lists are sorted, the CLI answers."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import pyrobdl

MODULES = ["pyrobdl", "pyrobdl.priors", "pyrobdl.likelihoods", "pyrobdl.guides", "pyrobdl.inference",
           "pyrobdl.poutine", "pyrobdl.datasets", "pyrobdl.diagnostics", "pyrobdl.posterior"]


@pytest.mark.parametrize("name", MODULES)
def test_all_resolves_and_is_sorted(name):
    module = importlib.import_module(name)
    assert module.__all__ == sorted(module.__all__)
    for attr in module.__all__:
        assert hasattr(module, attr), f"{name}.{attr} is in __all__ but missing"


def test_registry_has_the_foundation_methods():
    assert {"mean_field", "map"} <= set(pyrobdl.methods())
    assert pyrobdl.methods() == sorted(pyrobdl.methods())


def test_console_script_version_and_help():
    out = subprocess.run([sys.executable, "-m", "pyrobdl.cli", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and pyrobdl.__version__ in out.stdout
    out = subprocess.run([sys.executable, "-m", "pyrobdl.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout.lower()
