"""One name per thing: no public top-level function or class name is
defined in two modules of the project, so `load_encoder` or `labelled_rows` means one thing
wherever it is read. Entry points every stage module has by convention are allowed."""
import ast
from collections import defaultdict

from conftest import REPO

PACKAGES = ("octfm", "ingest", "manifests", "cache", "train", "evals", "check", "bench", "report")
# names that are an interface, one per module by design
ENTRY = {
    "main",     # each stage module's CLI entry (octfm.cli.run(main))
    "run",      # each bench suite's entry (bench/__main__.py SUITES), a stage's programmatic entry
    "build",    # make cache's and make manifest's build, and train.encoder.build (a config -> module)
    "plot",     # each report's own figure
    "markdown", # each report's own page
    "verdict",  # each check's own verdict line
    "summarize",    # each batch stage's closing summary (make expand, make cache)
    "default_out",  # each command's default output path (make leaderboard, make report)
    # a verb the module names the object of, always called qualified: config.load / checkpoint.load,
    # rclone_io.setup (rclone's config) / runtime.setup (the device and process group)
    "load", "setup",
}


def public_definitions() -> dict[str, list[str]]:
    where = defaultdict(list)
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                        and not node.name.startswith("_"):
                    where[node.name].append(str(path.relative_to(REPO)))
    return where


def test_no_public_name_is_defined_twice():
    twice = {name: files for name, files in public_definitions().items() if len(files) > 1 and name not in ENTRY}
    assert not twice, f"one name, several things: {twice}"
