"""pyproject.toml's Python floor is the one its dependencies need, and the `tpu` extra installs
beside the base dependencies on it (a TPU VM image with Python 3.10 cannot install
zarr >= 3.1, so the recipe brings its own Python)."""
import importlib.metadata as md
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from conftest import REPO

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def floor(spec: str) -> Version:
    """The lowest Python a Requires-Python allows (its >= bound)."""
    return max(Version(s.version) for s in SpecifierSet(spec) if s.operator in (">=", "=="))


def test_the_declared_python_is_the_highest_floor_of_the_dependencies():
    declared = floor(PROJECT["requires-python"])
    floors = {}
    for dep in PROJECT["dependencies"]:
        name = Requirement(dep).name
        spec = md.metadata(name).get("Requires-Python")
        if spec:
            floors[name] = floor(spec)
    assert declared >= Version("3.11") and floors["zarr"] >= Version("3.11")
    assert declared == max(floors.values()), (declared, {k: str(v) for k, v in floors.items() if v > declared})
    assert Version(".".join(map(str, sys.version_info[:2]))) in SpecifierSet(PROJECT["requires-python"])


def test_the_tpu_extra_pins_a_torch_the_base_dependencies_accept():
    tpu = {Requirement(r).name: Requirement(r) for r in PROJECT["optional-dependencies"]["tpu"]}
    base = {Requirement(r).name: Requirement(r) for r in PROJECT["dependencies"]}
    torch_pin = next(iter(tpu["torch"].specifier)).version
    xla_pin = next(iter(tpu["torch_xla"].specifier)).version
    assert torch_pin == xla_pin, "torch_xla needs exactly the torch of its own version (its wheel does not say so)"
    assert base["torch"].specifier.contains(torch_pin), (torch_pin, str(base["torch"].specifier))
    assert "tpu" in tpu["torch_xla"].extras


def test_an_xdist_worker_runs_torch_on_one_thread():
    """conftest.py sets OMP_NUM_THREADS=1 in each xdist worker before torch loads; a torch imported
    earlier (a plugin, a new import at conftest's top) would keep the machine-wide pool, and two such
    workers contend for the cores (docs/testing.md)."""
    import os

    import pytest
    import torch

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("not under pytest-xdist (make test runs it there)")
    assert torch.get_num_threads() == 1
