"""The key table spells each closed set of choices for parsing, `--help` and docs/cli.md: the spelling must be the
set the code that takes the value accepts, or a value the table lets through fails later, deep in a run, and a
value the code takes is refused at the door."""

import pytest

from bridge.gguf import WRITE_TYPES
from jaxft.memory import execution
from jaxft.train.dpo import LOSS_TYPES
from jaxft.train.keys import KEYS, MEMORY_CHOICES, _choices
from jaxft.train.schedules import SCHEDULES
from kernels_pallas.nf4_matmul.codes import QUANT_TYPES

ACCEPTED = {
    "lr_scheduler_type": SCHEDULES,
    "loss_type": LOSS_TYPES,
    "memory": tuple(execution.MEMORY_PRESETS),
    "attention_implementation": execution.ATTENTION_IMPLEMENTATIONS,
    "grouped_matmul_implementation": execution.GROUPED_MATMUL_IMPLEMENTATIONS,
    "moe_dispatch": execution.MOE_DISPATCHES,
    "bnb_4bit_quant_type": QUANT_TYPES,
    "offload_transfer": execution.OFFLOAD_TRANSFERS,
    "frozen_weights": execution.FROZEN_WEIGHTS,
    "layer_loop": execution.LAYER_LOOPS,
    "save_gguf": tuple(WRITE_TYPES),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_a_keys_choices_are_what_the_code_accepts(name):
    key = next(k for k in KEYS if k.name == name)
    assert set(_choices(key.type)) == set(ACCEPTED[name]), name


def test_the_memory_presets_are_the_memory_keys_choices():
    assert set(MEMORY_CHOICES) == set(execution.MEMORY_PRESETS)
