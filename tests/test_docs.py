"""What README.md and docs/ say about the code agrees with the code."""
import re

import pytest
import torch

from conftest import REPO
from train.optim import guarded_step


def _pages() -> list:
    """README.md and every page under docs/, docs/history/ included."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _docs() -> str:
    return "\n".join(p.read_text() for p in _pages())


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
def test_training_doc_names_each_guard_path(phrase):
    assert phrase in " ".join((REPO / "docs" / "training.md").read_text().split())


def test_readme_is_a_users_page():
    """README is at most 350 lines and names no numbered decision (docs/history/learning-check.md holds them)."""
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 350
    assert not [line for line in lines if re.search(r"\b[Dd]ecisions? F?\d", line)]


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page) -> set:
    """A page's link targets: its headings' anchors and its explicit `<a id="...">` ones (the decision log's
    `#decision-61`, which outlive a heading's rewording)."""
    text = page.read_text()
    return ({_slug(h.lstrip("#")) for h in text.splitlines() if h.startswith("#")}
            | set(re.findall(r'<a id="([^"]+)"></a>', text)))


def test_every_relative_link_resolves():
    """Links between README.md and docs/ name a file that exists and, with a #fragment, one of its anchors."""
    bad = []
    for doc in _pages():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if link.startswith(("http:", "https:", "mailto:")):
                continue
            path, _, frag = link.partition("#")
            target = (doc.parent / path) if path else doc
            if not target.exists():
                bad.append(f"{doc.name}: {link}")
            elif frag and target.suffix == ".md" and frag not in _anchors(target):
                bad.append(f"{doc.name}: {link} (no such heading)")
    assert not bad, bad


def test_each_decision_has_a_stable_anchor():
    """docs/history/learning-check.md#decision-N reaches decision N whatever its heading says, each
    anchor on its own line with a blank line before the heading (else markdown reads the heading as HTML)."""
    text = (REPO / "docs" / "history" / "learning-check.md").read_text()
    numbers = re.findall(r"^## Decision (F?\d+):", text, re.M)
    anchored = re.findall(r'^<a id="decision-(f?\d+)"></a>\n\n## Decision ', text, re.M)
    assert len(numbers) >= 60 and [n.lower() for n in numbers] == anchored


USER_PAGES = ("README.md", "docs/training.md", "docs/accelerators.md")
LABELS = r"\b(?:[Ii]ssue|[Ss]top|[Dd]ecision)s? #?F?\d+|\bthe (?:TPU )?issue\b|\bthe cut\b|house refactor|\b[0-9a-f]{7,40}\b"


@pytest.mark.parametrize("page", USER_PAGES)
def test_user_pages_carry_no_labels_a_user_cannot_resolve(page):
    """The pages a user runs from name no issue, stop, decision or commit and tell no past round (that is
    docs/history/); README's Results table, generated from docs/results.jsonl, keeps its provenance column."""
    text = re.sub(r"<!-- results -->.*?<!-- /results -->", "", (REPO / page).read_text(), flags=re.S)
    found = [m.group(0) for m in re.finditer(LABELS, text)]
    assert not found, found


def test_readme_links_the_docs_index_near_its_top():
    head = (REPO / "README.md").read_text().splitlines()[:15]
    assert any("(docs/README.md)" in line for line in head)
