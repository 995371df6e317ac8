"""The global batch is the recipe (train/batching.py): one config trains the same number of volumes
a step on any machine; each process's batch and the accumulation follow from the chips and
chip_batch, and a batch the chips cannot split is refused with the numbers."""
import pytest

from octfm import config
from octfm.config import ConfigError
from train import batching
from train.config import TrainConfig, per_process_batch, saved_config


@pytest.mark.parametrize("chips, processes, hosts, cap, want", [
    (8, 8, 1, None, (16, 1, 16)),     # a node of 8 GPUs: a process a card
    (16, 4, 4, None, (8, 1, 32)),     # a v4-32 under SPMD: a process a host feeds its 4 chips
    (16, 4, 4, 4, (4, 2, 16)),        # chips that hold 4: two micro-steps keep the 128
    (16, 4, 4, 3, (2, 4, 8)),         # 3 does not split 8 evenly: the fewest micro-steps that do
    (1, 1, 1, 16, (16, 8, 16)),       # one card reaches the recipe's batch by accumulation
])
def test_a_split_keeps_the_global_batch(chips, processes, hosts, cap, want):
    lay = batching.split(128, cap, chips, processes, hosts)
    assert (lay.per_chip, lay.accum, lay.per_process) == want
    assert lay.per_chip * lay.chips * lay.accum == 128 and lay.per_host * hosts == 128


def test_a_batch_the_chips_cannot_split_is_refused_with_the_numbers():
    with pytest.raises(ConfigError, match=r"'global_batch': 100 does not divide over 16 chip\(s\) \(4 process\(es\) "
                                          r"on 4 host\(s\)\): use a multiple of 16, e.g. 96"):
        batching.split(100, None, 16, 4, 4)
    with pytest.raises(ConfigError, match="chip_batch"):
        config.load(TrainConfig, "configs/pretrain_smoke.yaml", ["chip_batch=0"])


def test_a_checkpoint_that_stated_a_batch_per_process_reads_as_its_global_batch():
    """A v1 run saved `batch_size` per process and `optim.accum_steps`: its config reads back with
    the global batch they made on the processes that wrote it, every other key as saved."""
    now = config.to_dict(config.load(TrainConfig, "configs/pretrain_check.yaml"))
    old = {k: v for k, v in now.items() if k not in ("global_batch", "chip_batch")}
    old["batch_size"], old["optim"] = 4, {**now["optim"], "accum_steps": 2}
    assert per_process_batch(old, world=2)["global_batch"] == 16
    assert saved_config(old, "old.pt", world=1) == config.load(TrainConfig, "configs/pretrain_check.yaml",
                                                               ["global_batch=8"])
    assert per_process_batch(now) is now
