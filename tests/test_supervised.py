"""The learning check's supervised reference (evals/supervised.py) takes the config's loader
workers: the GPU size ships `data.workers: null`. Its CUDA run is in tests/test_cuda.py."""
import pytest
from conftest import tiny_train_args
from evals import supervised
from octfm import config
from train import checkpoint
from train.config import TrainConfig

SMOKE = "configs/pretrain_smoke.yaml"


def supervised_cfg(tiny_cache, tmp_path, *extra):
    args = [a for a in tiny_train_args(tiny_cache, tmp_path / "runs") if not a.startswith("data.workers=")]
    return config.load(TrainConfig, SMOKE, [*args, "data.workers=null", *extra])


def test_workers_null_means_the_default_loader_workers(tiny_cache, tmp_path):
    """data.workers: null is `data.loader_workers` (the cores less one), as in pretraining; it
    used to be compared with 0 and raised a TypeError at the GPU size's first reference."""
    cfg = supervised_cfg(tiny_cache, tmp_path, "device=cpu", "precision=fp32")
    assert cfg.data.workers is None
    path = supervised.train(cfg, "diabetic", str(tmp_path / "ckpt"), steps=2, progress=False)
    st = checkpoint.load(path)
    assert st["step"] == 2 and st["supervised"]["task"] == "diabetic"


def test_a_label_fraction_smaller_than_a_batch_trains_on_what_it_has(tiny_cache, tmp_path):
    """A small cohort's 25% or 10% of labels can hold fewer rows than batch_size (the GPU size's
    smoke run: about 50 rows at batch 128); the reference takes them all as its batch instead of
    stopping the check with a DataError after pretraining."""
    cfg = supervised_cfg(tiny_cache, tmp_path, "device=cpu", "precision=fp32", "data.workers=0")
    rows = supervised.task_rows(cfg)
    one = {rows[0]["participant_id"]}
    n = sum(r["participant_id"] in one for r in rows)
    assert 0 < n < cfg.batch_size
    path = supervised.train(cfg, "diabetic", str(tmp_path / "ckpt"), steps=10, progress=False, participants=one)
    assert checkpoint.load(path)["step"] == 10  # 10 steps: OneCycleLR's one-step warmup divided by zero


def test_the_stopping_rule_keeps_the_best_state_and_counts_only_past_the_warmup():
    """Decision 17's bookkeeping: a better score keeps the state, a tie keeps the earlier one, and
    only scores past the warmup count toward the patience."""
    import torch

    enc, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    best = {"score": -1.0, "step": 0, "state": None, "stale": 0, "history": []}
    stop = supervised.Stopping(every=10, patience=2)
    with torch.no_grad():
        enc.weight.fill_(1.0)
    assert not supervised.scored_stop(best, 10, 0.6, enc, head, stop, past_warmup=False)
    with torch.no_grad():
        enc.weight.fill_(2.0)  # a later state that val does not like better is not kept
    assert not supervised.scored_stop(best, 20, 0.5, enc, head, stop, past_warmup=False)  # in the warmup: not counted
    assert not supervised.scored_stop(best, 30, 0.6, enc, head, stop, past_warmup=True)   # a tie: one stale score
    assert best["step"] == 10 and best["stale"] == 1 and float(best["state"][0]["weight"][0, 0]) == 1.0
    assert supervised.scored_stop(best, 40, 0.55, enc, head, stop, past_warmup=True)      # the second: stop
    assert best["history"] == [[10, 0.6], [20, 0.5], [30, 0.6], [40, 0.55]]
    assert not supervised.scored_stop({**best, "stale": 0}, 50, 0.7, enc, head, stop, past_warmup=True)


def test_a_reference_that_stops_on_val_saves_its_best_val_state(tiny_cache, tmp_path, monkeypatch):
    """With `Stopping` the reference is scored on val every few steps and the checkpoint holds the
    best-scoring state, not the last one. The scores are scripted (a tiny val split ties too often to
    tell states apart); the real scorer runs in the GPU-size dry run (tests/test_learning_check.py)."""
    import torch

    script = iter([0.5, 0.9, 0.6, 0.6, 0.95])  # steps 2, 4, 6, 8: the best at 4, two stale past the warmup
    seen = {}

    def scripted(self, enc, head, rt):
        score = next(script)
        seen[score] = {k: v.clone() for k, v in enc.state_dict().items()}  # 0.6: the state at step 8, the last
        return score

    cfg = supervised_cfg(tiny_cache, tmp_path, "device=cpu", "precision=fp32", "data.workers=0", "batch_size=2")
    monkeypatch.setattr(supervised.ValScore, "__call__", scripted)
    path = supervised.train(cfg, "diabetic", str(tmp_path / "ckpt"), steps=30, progress=False,
                            stop=supervised.Stopping(every=2, patience=2))
    st = checkpoint.load(path)
    meta = st["supervised"]
    assert meta["val_history"] == [[2, 0.5], [4, 0.9], [6, 0.6], [8, 0.6]]  # stopped before the 0.95 at 10
    assert st["step"] == meta["best_step"] == 4 and meta["stopped_at"] == 8 and meta["best_val_balanced_accuracy"] == 0.9
    best, last = seen[0.9], seen[0.6]  # the states at steps 4 and 8
    assert all(torch.equal(st["target"][k], best[k]) for k in best)
    assert not all(torch.equal(st["target"][k], last[k]) for k in last)


def test_own_head_predictions_score_each_real_row_once_with_the_batch_edit(tiny_cache):
    """One scorer for the reference's own head (ValScore while it trains, the cohort screen after):
    the head's argmax per real row, padding dropped, each batch edited with its first row's index,
    and the encoder left in the mode it was in."""
    import torch

    from evals.supervised import own_head_predictions
    from train import data, encoder
    from train.config import ModelConfig
    from train.model import Encoder

    torch.manual_seed(0)
    shape = (8, 32, 32)
    enc = Encoder(ModelConfig(tubelet=(4, 16, 16), dim=16, depth=2, heads=2), shape)
    modes = []
    enc.register_forward_pre_hook(lambda m, _: modes.append(m.training))  # the mode each forward runs in
    head = torch.nn.Linear(16, 3)
    with torch.no_grad():
        head.weight.mul_(50.0)  # classes that move with the input, so a wrong row or mode shows
    rows = data.select_rows(str(tiny_cache), ["train", "val", "test"], None)
    batches = list(encoder.volume_batches(str(tiny_cache), rows, (1, 1, 1), shape, 2, pad=True))
    enc.eval()
    with torch.no_grad():
        want = torch.cat([head(enc.pool(enc(data.normalize(x)))).argmax(1)[:n] for x, n in batches]).numpy()
    enc.train()
    got = own_head_predictions(enc, head, batches)
    assert len(set(want.tolist())) > 1, "the test needs predictions that differ between rows"
    assert enc.training and got.shape == (len(rows),) and (got == want).all()
    assert modes[-len(batches):] == [False] * len(batches)  # scored in eval mode (stochastic depth off)
    starts = []

    def blank(x, start):
        starts.append(start)
        return torch.zeros_like(x)

    blanked = own_head_predictions(enc, head, batches, change=blank)
    with torch.no_grad():
        zero = head(enc.pool(enc(data.normalize(torch.zeros_like(batches[0][0]))))).argmax(1)[0].item()
    assert starts == list(range(0, len(rows), 2)) and (blanked == zero).all() and (want != zero).any()
