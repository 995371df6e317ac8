"""`make results`: README's Results table generated from learning-check result.json files."""
import json

import pytest

from bench import results_table
from conftest import REPO
from octfm import cli


def _row(diff, lo, hi, pre, rand, head):
    return {"pretrained_head": head, "random_head": head, "difference": diff, "difference_ci95": [lo, hi],
            "pretrained": pre, "random_init": rand}


def _result(**extra):
    """The parts of a result.json the table reads: the headline row is the pair's head kind
    (same_kind_chosen_on_val), not each encoder's own choice (chosen_on_val)."""
    diabetic = {"comparisons": {"chosen_on_val": _row(0.2, 0.1, 0.3, 0.8, 0.6, "linear"),
                                "same_kind_chosen_on_val": _row(0.1234, 0.0511, 0.19, 0.7, 0.5766, "attentive")}}
    return {"cue": "lesions", "size": "cpu", "commit": "abc1234", "cohort_seed": 29, "overrides": [], "random_draws": 3,
            "tasks": {"diabetic": diabetic, "study_group": {}},
            "stages": {"cohort": {"wall_s": 100.0}, "pretrain": {"wall_s": 400.0},
                       "references and fine-tuning": {"wall_s": 300.0},
                       "finetune_10pct": {"wall_s": 250.0, "together": "references and fine-tuning"}},
            "verdict": "learning-check [lesions]: PASS: pretrained - random-init ...", **extra}


def test_a_record_holds_the_headline_each_verdict_and_the_wall():
    rec = results_table.record(_result(
        label_efficiency={"verdict": "label efficiency [lesions]: FAIL: at 10%"},
        finetune={"verdict": "fine-tuning, from the checkpoint ...: FAIL (target ...)"}), date="2026-12-02")
    assert rec["headline"] == {"task": "diabetic", "head": "attentive", "difference": 0.123, "ci95": [0.051, 0.19],
                               "pretrained": 0.7, "random_init": 0.577, "random_draws": 3}
    assert rec["verdicts"] == {"learns": "PASS", "label_efficiency": "FAIL", "finetune": "FAIL"}
    assert rec["wall_s"] == 800.0  # a job run inside a group counts in the group's time, not again
    assert results_table.row(rec) == ("| lesions | cpu | seed 29 | +0.123 [+0.051, +0.190] (attentive) | PASS | FAIL | "
                                      "FAIL | 13m20s | abc1234, 2026-12-02 |")


def test_a_question_not_asked_stays_absent_and_a_result_from_before_the_cut_is_refused():
    res = _result(label_efficiency={"verdict": "label efficiency [lesions]: NOT READ: no supervised reference"})
    assert results_table.record(res)["verdicts"] == {"learns": "PASS", "label_efficiency": "NOT READ"}
    assert "| PASS | NOT READ | - |" in results_table.row(results_table.record(res))
    old = {k: v for k, v in _result().items() if k not in ("size", "commit")}
    with pytest.raises(cli.UsageError, match="before the v1 cut"):
        results_table.record(old)


def test_a_rerun_of_the_same_check_replaces_its_record_and_another_check_adds_one():
    first = results_table.record(_result(commit="a"))
    again = results_table.record(_result(commit="b"))
    variant = results_table.record(_result(overrides=["model.pred_heads=2"], commit="c"))
    gpu = results_table.record(_result(size="gpu", commit="d"))
    records = results_table.upsert(results_table.upsert(results_table.upsert([first], variant), again), gpu)
    assert [r["commit"] for r in records] == ["b", "c", "d"]


def test_make_results_writes_the_record_and_rewrites_only_the_readme_block(tmp_path):
    result = tmp_path / "result.json"
    readme, records = tmp_path / "README.md", tmp_path / "results.jsonl"
    readme.write_text("# x\n<!-- results -->\nold rows\n<!-- /results -->\nafter\n")
    for commit in ("abc", "def"):  # the same check run again at another commit: its record replaced
        result.write_text(json.dumps(_result(commit=commit)))
        assert results_table.main([str(result), "--readme", str(readme), "--records", str(records)]) == 0
    (rec,) = [json.loads(ln) for ln in records.read_text().splitlines()]
    assert rec["commit"] == "def" and rec["cohort"] == 29
    text = readme.read_text()
    assert text.startswith("# x\n<!-- results -->\n| cue |") and text.endswith("<!-- /results -->\nafter\n")
    assert "old rows" not in text and text.count("| lesions |") == 1
    readme.write_text("no block\n")
    with pytest.raises(cli.UsageError, match="no <!-- results -->"):
        results_table.main(["--readme", str(readme), "--records", str(records)])


def test_readme_holds_the_table_the_records_make():
    """README's block is what the committed records render (a hand edit of either shows here)."""
    records = results_table.read_records(REPO / results_table.RECORDS)
    text = (REPO / "README.md").read_text()
    block = text.split(results_table.BEGIN, 1)[1].split(results_table.END, 1)[0]
    assert block.strip().splitlines() == results_table.results_rows(records)
