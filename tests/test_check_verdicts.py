"""The learning check's verdict lines (check/verdicts.py): one per question, each against its target,
and a question not asked or not read says so."""
from check import verdicts


def test_each_question_has_its_own_verdict_line():
    """A passing headline with a failing label efficiency reads PASS on the learns line (one line
    folded both before, so the headline read FAIL), and FAIL on its own line; fine-tuning adds its own."""
    def point(f, p, s=None):
        return {"fraction": f, "pretrained": {"balanced_accuracy": p},
                **({"supervised": {"balanced_accuracy": s}} if s is not None else {})}

    row = {"difference": 0.106, "difference_ci95": [0.052, 0.162], "pretrained": 0.74, "random_init": 0.634,
           "pretrained_head": "linear"}
    tasks = {t: {"comparisons": {"same_kind_chosen_on_val": row}} for t in ("diabetic", "study_group")}
    res = {"cue": "lesions", "protocol": "splits", "target": 0.10, "tasks": tasks, "random_draws": 3,
           "label_efficiency": {"points": [point(0.1, 0.630, 0.776), point(0.25, 0.7), point(1.0, 0.74)]}}
    res["verdict"] = verdicts.verdict(res)
    res["label_efficiency"]["verdict"] = verdicts.label_efficiency_verdict(res)
    learns, efficiency, tuning = verdicts.verdict_lines(res)
    assert tuning.startswith("fine-tuning [lesions]: NOT ASKED")
    assert learns.startswith("learning-check [lesions]: PASS: ") and "+0.106 [+0.052, +0.162]" in learns
    assert "supervised" not in learns
    assert efficiency == ("label efficiency [lesions]: FAIL: at 10% of labels frozen pretrained 0.630 vs supervised "
                          "0.776 (target: pretrained >= supervised)")
    res["finetune"] = {"verdict": "fine-tuning, ...: PASS (target ...)\n- 10% of labels: ...",
                       "against_supervised": "fine-tuned at 10% of labels vs the supervised reference ..."}
    assert verdicts.verdict_lines(res)[2:] == [res["finetune"]["against_supervised"], res["finetune"]["verdict"]]
    asked_nothing = {**res, "label_efficiency": {"points": [point(0.1, 0.630)]}, "finetune": None}   # the default
    assert [ln.split(": ")[1] for ln in verdicts.verdict_lines(asked_nothing)[1:]] == ["NOT ASKED", "NOT ASKED"]
    failing = {**row, "difference_ci95": [-0.01, 0.2]}                 # the interval not above 0: the headline fails
    assert verdicts.verdict({**res, "tasks": {t: {"comparisons": {"same_kind_chosen_on_val": failing}}
                                              for t in tasks}}).startswith("learning-check [lesions]: FAIL: ")


def test_a_reference_only_above_the_smallest_fraction_says_the_target_was_not_read():
    """A reference at 25% only: the label-efficiency line names its target as not read, rather than
    dropping it silently; with no reference at all there is no such line."""
    def pt(f, sup):
        return {"fraction": f, "pretrained": {"balanced_accuracy": 0.6},
                **({"supervised": {"balanced_accuracy": 0.7}} if sup else {})}

    def line(*points):
        return verdicts.label_efficiency_verdict({"cue": "layers", "label_efficiency": {"points": list(points)}})

    assert line(pt(0.1, False), pt(0.25, True), pt(1.0, False)) == \
        "label efficiency [layers]: NOT READ: no supervised reference at 10% of labels"
    assert line(pt(0.1, False)) is None
    assert line(pt(0.1, True)).startswith("label efficiency [layers]: FAIL: at 10% of labels frozen pretrained 0.600")
