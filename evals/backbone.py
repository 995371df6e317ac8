"""The encoder a fine-tuning run starts from: a pretraining checkpoint's EMA target, a model
folder's weights, or the same architecture from random init (the supervised reference). Kept
apart from the loop (evals/finetune.py) so that readers of a start need not read the trainer."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch

from evals import features
from evals.config import FinetuneConfig
from octfm import cli
from train import checkpoint, data, encoder, shares
from train.config import DataConfig, TrainConfig
from train.model import Encoder


class Backbone(NamedTuple):
    encoder: Encoder
    train_config: TrainConfig   # architecture, input and cache of the encoder (a model folder's, rebuilt)
    ident: dict                 # what it was loaded from


def is_model_folder(path: str) -> bool:
    return (Path(path) / encoder.CONFIG_FILE).is_file()


def training_seed(cfg: FinetuneConfig) -> int:
    """The seed of everything random in training; `seed` alone picks the labelled participants."""
    return cfg.seed if cfg.train_seed is None else cfg.train_seed


def load_backbone(cfg: FinetuneConfig) -> Backbone:
    """The encoder to fine-tune: a checkpoint's EMA target, or a model folder's weights; with
    `init: random` the same architecture freshly initialised from the training seed."""
    if not cfg.ckpt:
        raise cli.UsageError("ckpt: set CKPT=<checkpoint or model folder> (or ckpt: in the config)")
    if is_model_folder(cfg.ckpt):
        enc, tcfg, ident = folder_encoder(cfg.ckpt)
    else:
        enc, tcfg, ident = features.checkpoint_encoder(cfg.ckpt)
    if cfg.init == "random":
        torch.manual_seed(training_seed(cfg))
        enc = Encoder(tcfg.model, tcfg.data.input_shape)
        ident = {**ident, "init": "random", "seed": training_seed(cfg)}
    cache = cfg.cache or shares.whole_cache(tcfg.data.cache, "finetune")
    if cache != tcfg.data.cache:
        tcfg = dataclasses.replace(tcfg, data=dataclasses.replace(tcfg.data, cache=cache))
    return Backbone(enc, tcfg, ident)


def folder_encoder(folder: str) -> tuple[Encoder, TrainConfig, dict]:
    """A model folder's encoder and a training config that rebuilds it (architecture, stride,
    input shape; the rest, data.scale among it, the recipe's defaults), so the best epoch is saved
    in the checkpoint format every stage reads."""
    conf = encoder.read_config(folder)
    module = encoder.load_encoder(folder)
    if (module.mean, module.std) != (data.PIXEL_MEAN, data.PIXEL_STD):
        raise cli.UsageError(f"{folder}/{encoder.CONFIG_FILE}: normalization {conf['normalization']} is not the "
                             f"trainer's ({data.PIXEL_MEAN}, {data.PIXEL_STD}); fine-tuning would feed it other inputs")
    tcfg = TrainConfig(model=encoder.architecture(conf), data=DataConfig(
        cache=conf["cache"]["uri"], stride=module.stride, input_shape=module.input_shape))
    return module.encoder, tcfg, {"model_folder": str(folder), **checkpoint.identity(str(Path(folder) / encoder.WEIGHTS_FILE))}
