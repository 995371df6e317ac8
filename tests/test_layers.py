"""The floors (docs/architecture.md): which package may import which, checked on every module's imports."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STAGES = ("ingest", "manifests", "cache", "train", "evals", "check", "report", "bench")
# package -> the top-level packages of this repository it must not import
FORBIDDEN = {
    "octfm": set(STAGES),
    "manifests": {"train", "evals", "check", "report", "bench"},
    "ingest": {"train", "evals", "check", "report", "bench"},
    "cache": {"train", "evals", "check", "report", "bench"},
    "train": {"evals", "check", "report", "bench"},
    "evals": {"check", "report", "bench"},   # the commands users run to evaluate an encoder; the harness sits above
    "check": {"report", "bench"},            # the learning check: nothing below imports it
}


def imported_packages(path: Path) -> set[tuple[int, str]]:
    """(line, top-level package) of every import in a module, at any depth (late imports count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, a.name.split(".")[0]) for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.lineno, node.module.split(".")[0]))
    return found


def violations(root: Path = REPO) -> list[str]:
    out = []
    for package, banned in FORBIDDEN.items():
        for path in sorted((root / package).rglob("*.py")):
            out += [f"{path.relative_to(root)}:{line} imports {name} (a {package} module may not)"
                    for line, name in sorted(imported_packages(path)) if name in banned]
    return out


def test_every_package_keeps_to_its_floor():
    assert violations() == []


@pytest.mark.parametrize("package,planted", [("octfm", "from cache import store"), ("manifests", "import evals.probe"),
                                             ("train", "def f():\n    from report import page\n")])
def test_a_planted_import_is_caught(tmp_path, package, planted):
    """The check can fail: the same walk over a copy of the tree with one forbidden import added."""
    for name in FORBIDDEN:
        (tmp_path / name).mkdir()
        for src in (REPO / name).glob("*.py"):
            (tmp_path / name / src.name).write_text(src.read_text())
    (tmp_path / package / "planted.py").write_text(planted + "\n")
    found = violations(tmp_path)
    assert len(found) == 1 and found[0].startswith(f"{package}/planted.py:"), found

