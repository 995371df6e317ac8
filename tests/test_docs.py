"""What README.md and docs/ say about the code agrees with the code."""
import re

import pytest
import torch

from conftest import REPO
from train.step import guarded_step


def _docs() -> str:
    return "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])


def test_update_guard_is_described_as_it_runs():
    """The guard's copy-and-select path runs off the CPU only, and its measured cost is quoted
    as one number wherever it is quoted (it once read 30% in one place and 42% in another, and
    "branch-free on every backend" beside a CPU branch)."""
    text = " ".join(_docs().split())
    assert "branch-free on every backend" not in text and "CPU tests exercise what XLA runs" not in text
    costs = set(re.findall(r"(\d+)% of a ViT-B (?:CPU )?step", text))
    assert len(costs) == 1, f"the guard's cost is quoted as {sorted(costs)}%"
    # the paths as described: a branch on the CPU, copy-and-select elsewhere (the default of select=None)
    calls = []

    class Opt:
        param_groups: list = []
        defaults: dict = {}

        def step(self):
            calls.append("step")

    guarded_step(Opt(), torch.tensor(False))                  # CPU: a branch, no step at all
    assert calls == []


@pytest.mark.parametrize("phrase", ["CPU and CUDA: AdamW runs fused", "XLA: branch-free", "A host branch"])
def test_readme_names_each_guard_path(phrase):
    assert phrase in " ".join((REPO / "README.md").read_text().split())
