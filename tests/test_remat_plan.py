"""`remat_plan`: runs of layers each under a policy of its own (then `remat` on the rest), on unrolled layers. The
gradients equal no remat's, each layer's program holds its own policy's host copies and nothing else, offload_all's
host budget is spread over the layers that take it, and bad plans get one line naming the key."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from jaxft.execution import ExecutionConfig, ExecutionConfigError
from jaxft.remat import budget_offload_all, canonical_plan, parse, spelled_plan
from jaxft.train.step import loss_and_grad_sums, stack_micro_batches, unstack_layers
from test_remat import assert_grads_match, grads, llama, lora_split, packed_batch
from test_train_fixtures import make_tiny_model

DATA = str(Path(__file__).resolve().parents[1] / "examples" / "data" / "train.jsonl")


SELECTIVE = "save=attn_out;offload=layer_input"


@pytest.fixture(scope="module")
def no_remat():
    cfg = llama(layers=4)
    split = lora_split(cfg)
    return cfg, split, grads(cfg, split, "none", "unroll")


@pytest.mark.parametrize("plan, rest", [("full:1|offload_all:1|offload+attn:1", "none"),
                                        ([["offload", 2]], "full"),
                                        ({SELECTIVE: 1, "none": 1, "full": 1}, "offload_all")])
def test_a_plan_gives_the_gradients_of_no_remat(no_remat, plan, rest):
    """fp32, 4 layers, packed rows of three documents: to 2e-6 of each gradient's largest entry (the bound of
    tests/test_remat.py: checkpointed layers fuse differently, so a few fp32 sums round in another order)."""
    cfg, split, (loss0, g0) = no_remat
    assert_grads_match(*grads(cfg, split, rest, "unroll", remat_plan=plan), loss0, g0)


def _host_placements(cfg, **execution) -> int:
    graphdef, lora, frozen = lora_split(cfg)
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", layer_loop="unroll", **execution)
    fn = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])
    hlo = fn.trace(lora, unstack_layers(frozen), batch).lower(lowering_platforms=("cuda",)).as_text()
    return hlo.count('_xla_buffer_placement = "pinned_host"')


def test_each_layer_offloads_what_its_own_policy_names():
    """Lowered for CUDA: offload moves one residual of a layer to the host, offload+attn one too (its attention
    residuals stay on the device), full and none none. A plan's count is the sum over its layers."""
    cfg = llama(layers=4)
    one = _host_placements(cfg, remat="offload")
    assert one == 4  # one layer input per layer
    assert _host_placements(cfg, remat="none", remat_plan="offload:2|full:1") == 2
    assert _host_placements(cfg, remat="offload", remat_plan="full:1|none:1") == 2  # the rest: layers 2 and 3
    assert _host_placements(cfg, remat="none", remat_plan="offload+attn:1|full:2|offload:1") == 2


def _vjps_and_barriers(cfg, plan: str) -> tuple[int, int]:
    graphdef, lora, frozen = lora_split(cfg)
    batch = stack_micro_batches(packed_batch(cfg.vocab_size), 1)
    ex = ExecutionConfig(attention_implementation="reference", remat="none", remat_plan=plan, layer_loop="unroll")
    fn = jax.jit(lambda lo, fz, b: loss_and_grad_sums(graphdef, lo, fz, b, None, ex)[1])
    text = str(jax.make_jaxpr(fn)(lora, unstack_layers(frozen), batch))
    return text.count("custom_vjp_call"), text.count("optimization_barrier")


def test_full_layers_of_a_plan_that_offloads_take_the_ordered_vjp():
    """In a plan that moves residuals to the host, a full layer runs through jaxft.offload's custom VJP with its
    input kept on the device, whose barriers hold the recompute until the layer's own backward (compiled for an
    H200, 8B at 1 x 16384 packed, full on 16 layers and offload_all on 16: temp 33.74 -> 12.52 GiB): the same
    custom VJPs and barriers as offload on those layers. Without offloading layers, full stays jax.checkpoint."""
    cfg = llama(layers=4)
    assert _vjps_and_barriers(cfg, "full:2|offload:2") == _vjps_and_barriers(cfg, "offload:4")
    assert _vjps_and_barriers(cfg, "none:2|offload:2")[1] < _vjps_and_barriers(cfg, "offload:4")[1]
    assert _vjps_and_barriers(cfg, "full:2")[1] == 0


def test_offload_all_spreads_its_host_budget_over_its_own_layers():
    """With `host_memory_gb` offload_all keeps the residual names whose bytes over the layers that take it fit:
    on 1 layer of 4 a budget can hold names that it cannot hold over every layer."""
    cfg = llama(layers=4)
    everywhere, total = budget_offload_all(cfg, 1, 1024, 2, None)
    gb = 1.5 * total / 4 / 2**30  # 1.5 layers' worth of every name
    over_all, _ = budget_offload_all(cfg, 1, 1024, 2, gb)
    over_one, _ = budget_offload_all(cfg, 1, 1024, 2, gb, layers=1)
    assert over_one == everywhere and len(over_all) < len(everywhere)
    policies = ExecutionConfig(remat="none", remat_plan="offload_all:1", host_memory_gb=gb).layer_policies(
        cfg, 1, 1024, 2)
    assert len(policies) == 4 and policies[0].offload == over_one and policies[1:] == (parse("none"),) * 3
    assert ExecutionConfig(remat="offload_all", host_memory_gb=gb).layer_policy(cfg, 1, 1024, 2).offload == over_all


def test_remat_layers_is_a_one_run_plan():
    cfg = llama(layers=4)
    as_layers = ExecutionConfig(remat="full", remat_layers=3).layer_policies(cfg, 1, 64, 4)
    assert as_layers == ExecutionConfig(remat="none", remat_plan="full:3").layer_policies(cfg, 1, 64, 4)
    assert as_layers == (parse("full"),) * 3 + (parse("none"),)
    assert ExecutionConfig(remat="full", remat_layers=9).layer_policies(cfg, 1, 64, 4) == (parse("full"),) * 4
    assert ExecutionConfig(remat="full").layer_policies(cfg, 1, 64, 4) is None


def test_plans_are_canonical_in_every_spelling():
    want = (("full", 8), ("offload_all", 12))
    assert canonical_plan("full:8|offload_all:12") == canonical_plan([["full", 8], ["offload_all", 12]]) == \
        canonical_plan({"full": 8, "offload_all": 12}) == want
    assert spelled_plan(want) == "full:8|offload_all:12"
    assert canonical_plan(" save = attn_out ; offload=layer_input : 2 ") == (("save=attn_out;offload=layer_input", 2),)
    ex = ExecutionConfig(remat_plan=[["full", 8]])
    assert ex.remat_plan == (("full", 8),) and ex.resolved_layer_loop == "unroll"
    assert hash(ex) == hash(ExecutionConfig(remat_plan="full:8")) and ex == ExecutionConfig(remat_plan="full:8")
    assert ExecutionConfig(remat_plan="full:8").resolved_ce_chunk(4096, 64, 32, 2) is not None  # sized as remat


@pytest.mark.parametrize("kwargs, needle", [
    (dict(remat_plan="full:0"), "key 'remat_plan': the layer count 0 of 'full' must be an integer >= 1"),
    (dict(remat_plan="full"), "key 'remat_plan': 'full': part 'full' is not POLICY:LAYERS"),
    (dict(remat_plan="fulll:2"), "key 'remat_plan': value 'fulll' is not a policy"),
    (dict(remat_plan="auto:2"), "key 'remat_plan': 'auto' cannot be a segment's policy"),
    (dict(remat_plan=[]), "key 'remat_plan': [] is empty"),
    (dict(remat_plan=3), "key 'remat_plan': 3 is not a plan"),
    (dict(remat="auto", remat_plan="full:2"), "key 'remat_plan': is set but remat is 'auto'"),
    (dict(remat="full", remat_layers=2, remat_plan="full:2"), "key 'remat_plan': and remat_layers both say"),
    (dict(remat_plan="full:2", layer_loop="scan"), "key 'remat_plan': needs the unrolled layer loop"),
    (dict(remat="full", remat_block=2, remat_plan="full:2"), "key 'remat_block': nests one policy's layers"),
])
def test_bad_plans_get_one_line_naming_the_key(kwargs, needle):
    with pytest.raises(ExecutionConfigError) as info:
        ExecutionConfig(**kwargs)
    assert str(info.value).startswith(needle) and "\n" not in str(info.value)


def test_a_plan_longer_than_the_model_is_cut_at_its_last_layer():
    """As remat_layers >= L means every layer: a recipe sized for a 32-layer model runs on a shallower one."""
    policies = ExecutionConfig(remat_plan="full:3|offload:2").layer_policies(llama(layers=4), 1, 64, 4)
    assert [p.kind for p in policies] == ["full"] * 3 + [parse("offload").kind]
    assert policies[3] == ExecutionConfig(remat="offload").layer_policy(llama(layers=4), 1, 64, 4)


def test_the_yaml_list_and_the_command_line_string_reach_the_execution_config(tmp_path):
    from jaxft.train import load_config

    model = make_tiny_model(tmp_path / "m", hidden=32, layers=2)
    path = tmp_path / "run.yaml"
    path.write_text(f"model_name_or_path: {model}\ndataset: {DATA}\noutput_dir: {tmp_path / 'o'}\n"
                    "remat: none\nremat_plan:\n  - [full, 1]\n  - [offload_all, 1]\n")
    assert load_config(path).execution.remat_plan == (("full", 1), ("offload_all", 1))
    assert load_config(path, ["remat_plan=offload:2"]).execution.remat_plan == (("offload", 2),)
    with pytest.raises(Exception) as info:
        load_config(path, ["remat_plan=full:x"])
    assert "key 'remat_plan'" in str(info.value) and "'x'" in str(info.value)


def test_a_run_with_a_plan_trains_as_no_remat_and_logs_the_plan(tmp_path, caplog):
    """jaxft-train's path (jaxft.train.train) on a tiny 3-layer Llama: a plan of full, offload_all and none trains
    to no remat's losses, and the log names each run of layers and what it sends to the host."""
    from test_train_fixtures import tiny_run_losses

    def losses(name, **remat):
        with caplog.at_level("INFO", logger="jaxft.train"):
            return tiny_run_losses(tmp_path, name, **remat)

    want = losses("none", remat="none")
    caplog.clear()
    got = losses("plan", remat="none", remat_plan="full:1|offload_all:1")
    assert len(got) == len(want) == 3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("remat plan "))
    assert line.startswith("remat plan full:1|offload_all:1: layers 0-0 full; layers 1-1 offload_all (")
    assert line.endswith("GiB to host); layers 2-2 none")
