"""The learning check's kept results and their names (check/run_names.py): what keys a run (its code's
import closure, its cache), what an edit makes afresh and what it keeps, and names that keep apart the
runs and jobs they name."""
import json

import pytest

from check import learning_check, run_names
from octfm import config


def test_the_import_closure_follows_every_kind_of_import(tmp_path, monkeypatch):
    """config.import_closure, which keys the check's results: `import a.b`, `from a import b` (b a
    module), a function's own import, relative imports and each package's __init__ join it; a module
    of no package here (the standard library) and a file nothing imports do not."""
    from octfm import config

    files = {"pkg/__init__.py": "", "pkg/entry.py": "import os\nimport pkg.sub.deep\nfrom pkg import mod\n"
             "def f():\n    from pkg.lazy import x\n", "pkg/mod.py": "", "pkg/lazy.py": "", "pkg/unused.py": "",
             "pkg/sub/__init__.py": "", "pkg/sub/deep.py": "from . import rel\nfrom ..up import y\n",
             "pkg/sub/rel.py": "", "pkg/up.py": "", "loose.py": ""}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(config, "REPO_ROOT", tmp_path)
    assert config.import_closure("pkg/entry.py") == sorted(set(files) - {"pkg/unused.py", "loose.py"})


def test_an_edit_to_the_memory_plan_keeps_the_runs_and_one_to_the_trainer_does_not(tmp_path, monkeypatch):
    from conftest import REPO, keys_after_edits

    cfg = str(REPO / "configs/pretrain_check.yaml")
    names = lambda: (run_names.recipe_name(cfg, "c", []), run_names.finetune_tag("random", 0.1, None, 0))  # noqa: E731
    packages = {f.split("/")[0] for f in run_names.keyed_files(run_names.FINETUNE_CODE)} | {"train"}
    before, plan_edited, after = keys_after_edits(tmp_path, monkeypatch, packages, names,
                                                  ["train/plan.py", "train/schedule.py"])
    assert plan_edited == before
    assert all(a != b for a, b in zip(after, before))


@pytest.mark.slow  # five subprocesses over a copy of the sources (about 20 s): the heavy lane, beside the end-to-end check
def test_kept_results_are_keyed_on_the_code(tmp_path):
    """A copy of the sources: editing train/ gives the recipe a new run name (it trains afresh
    instead of answering "nothing to do" from runs older code made), editing the probes keeps the
    pretraining but not fine-tuning (the references too: they are its from-scratch runs, and it can
    start from a fitted probe), editing evals/finetune.py retrains fine-tuning alone, and editing
    the generator makes the cohort afresh; unedited, all are reused."""
    import shutil
    import subprocess
    import sys

    from conftest import REPO

    copy = tmp_path / "repo"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", ".venv", "data", "runs", "tests", "__pycache__",
                                                              "*.egg-info"))
    probe = ("import sys; from pathlib import Path; from check import learning_check as lc; "
             "print(lc.recipe_name('configs/pretrain_check.yaml', 'c', ['max_steps=4'])); "
             "print(lc.finetune_tag('random', 0.1, None, 0)); "
             "import dataclasses; from check.cohort import COHORT; "
             "lc.cohort(Path(sys.argv[1]), dataclasses.replace(COHORT, participants=4))")

    def run():
        r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "cohort")], cwd=copy, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        lines = r.stdout.splitlines()
        return (lines[0], lines[1]), lines[-1].endswith("reused")

    first, _ = run()
    assert run() == (first, True)                                    # nothing changed: all reused
    with open(copy / "evals" / "probe.py", "a") as f:
        f.write("\n# an edit\n")
    (pre0, tune0), reused = run()   # a probe edit keeps the pretraining; fine-tuning fits its start as the probes fit
    assert pre0 == first[0] and tune0 != first[1] and reused
    with open(copy / "evals" / "finetune.py", "a") as f:
        f.write("\n# an edit\n")
    (pre, tune), reused = run()
    assert pre == pre0 and tune != tune0 and reused                  # fine-tuning's code: only it trains afresh
    with open(copy / "train" / "model.py", "a") as f:
        f.write("\n# an edit\n")
    second, reused = run()
    assert second[0] != pre and second[1] != tune and reused        # a trainer edit: new runs, the same cohort
    with open(copy / "ingest" / "synth.py", "a") as f:
        f.write("\n# an edit\n")
    assert run() == (second, False)                                  # a generator edit: the cohort anew


def test_a_fine_tuning_run_is_named_for_the_seed_that_picks_its_participants():
    """A run trained on one label fraction's participants is not reused for another
    subset (a re-run with `--probe seed=N` draws other participants); the references are such runs."""
    from pathlib import Path

    a, b = (run_names.finetune_tag("random", 0.1, None, s) for s in (0, 1))
    assert a != b and "_10pct_" in a and Path(a).name == a
    assert a == run_names.finetune_tag("random", 0.1, None, 0)


# what each kept result runs: the entry files that make it (its key must hold every file they import)
MADE_BY = {"COHORT_CODE": ("ingest/synth.py",),                  # cohort.cohort
           "PRETRAIN_CODE": ("train/pretrain.py", "cache/build.py"),   # the run reads the cache, named by its path
           "FINETUNE_CODE": ("evals/finetune.py",)}


def test_every_file_a_kept_results_code_imports_keys_it():
    """A key that lacks a file its entry imports resumes results an older version of
    that file made (FINETUNE_CODE lacked evals/features.py, probe_metrics.py and supervised.py). Each
    entry is imported in a child of one process (the heavy third-party imports shared) and every
    repository file it loaded must be keyed."""
    import subprocess
    import sys

    from conftest import REPO

    entries = sorted({e for es in MADE_BY.values() for e in es})
    code = """if True:
        import importlib, json, os, sys
        import monai, numpy, pandas, torch, zarr  # noqa: F401  (loaded once, before the children)
        for entry in sys.argv[1:]:
            if os.fork() == 0:
                try:
                    importlib.import_module(entry[:-3].replace("/", "."))
                    files = sorted(rel for rel in (os.path.relpath(m.__file__) for m in list(sys.modules.values())
                                                   if os.path.isabs(getattr(m, "__file__", None) or "")
                                                   and m.__file__.startswith(os.getcwd() + os.sep))
                                   if rel.split(os.sep)[0] in PACKAGES)  # not a venv inside the checkout
                    print(json.dumps([entry, files]), flush=True)
                finally:
                    os._exit(0)
            os.wait()
    """
    import tomllib

    packages = [p.rstrip("*") for p in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]]
    code = code.replace("PACKAGES", repr(set(packages)))
    out = subprocess.run([sys.executable, "-c", code, *entries], cwd=REPO, capture_output=True, text=True, check=True)
    loaded = dict(json.loads(line) for line in out.stdout.splitlines())
    assert set(loaded) == set(entries) and all(entry in files for entry, files in loaded.items())
    missing = {key: sorted({f for e in made_by for f in loaded[e]} - set(run_names.NOT_KEYED) -
                           set(run_names.keyed_files(getattr(run_names, key))))
               for key, made_by in MADE_BY.items()}
    assert missing == {key: [] for key in MADE_BY}


def test_fractions_that_round_to_one_percent_get_distinct_names():
    """0.1 and 0.104 both read "10%" when rounded: the learning check's jobs (named by pct), the rows'
    keys and the fine-tuning runs' folders (finetune_tag) would take one for the other. Whole
    percentages keep their names (and so their run folders)."""
    from check.run_names import finetune_tag
    from check.learning_check import job_name
    from check.verdicts import pct

    assert pct(0.1) != pct(0.104) and pct(0.104) == "10.4%"
    assert job_name("random", 0.1) != job_name("random", 0.104)
    assert job_name("pretrained", 0.1, 7) == "fine-tuning (pretrained init, training seed 7), 10% of labels"
    assert finetune_tag("random", 0.1, None, 0) != finetune_tag("random", 0.104, None, 0)
    assert [pct(f) for f in (0.1, 0.25, 1.0, 1)] == ["10%", "25%", "100%", "100%"]
    assert finetune_tag("random", 0.1, 3, 0).startswith("random_10pct_s0_t3_")
