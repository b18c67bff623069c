"""Training (LoRA adapters, or every weight: `jaxft.train.full`): config, the jitted step, checkpoints, metrics,
and `train(config) -> TrainResult`."""

from jaxft.train.checkpoint import CheckpointError, Checkpointer
from jaxft.train.config import TrainConfig, TrainConfigError
from jaxft.train.config_file import load_config
from jaxft.train.guard import TrainingInterrupted
from jaxft.train.loop import TrainResult, train
from jaxft.train.meter import RunSummary
from jaxft.train.metrics import read_metrics
from jaxft.train.optim import make_optimizer
from jaxft.train.schedules import make_schedule, warmup_steps_for
from jaxft.train.step import (
    loss_and_grad_sums,
    make_eval_step,
    make_train_step,
    restack_layers,
    split_model,
    stack_micro_batches,
    token_loss_sum,
    unstack_layers,
)

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "TrainingInterrupted",
    "RunSummary",
    "load_config",
    "loss_and_grad_sums",
    "make_eval_step",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "read_metrics",
    "restack_layers",
    "split_model",
    "stack_micro_batches",
    "token_loss_sum",
    "train",
    "unstack_layers",
    "warmup_steps_for",
]
