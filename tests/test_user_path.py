"""What a new user meets first: `remat: auto`'s default budget on a CPU, a TRL config, the merged export's
generation defaults, chat content that is not a string, prompts longer than the context, and every bad record
named at once."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxft.auto import GIB, STREAMED, MemoryBudgetError, default_memory_budget, host_available_memory
from jaxft.execution import ExecutionConfig
from jaxft.lora import LoraConfig
from jaxft.remat import parse
from jaxft.run import Run
from test_train_fixtures import make_tiny_model

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY_LLAMA = EXAMPLES / "tiny-llama"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("user") / "model", hidden=64, layers=2)


# ------------------------------------------------------------------------------------------ remat auto on a CPU
def _meminfo(path: Path, *, total: float, free: float, available: float) -> Path:
    """A /proc/meminfo of a host whose page cache holds what MemFree lacks (sizes in GiB)."""
    kb = lambda gib: int(gib * GIB // 1024)  # noqa: E731
    path.write_text(f"MemTotal:       {kb(total)} kB\nMemFree:        {kb(free)} kB\n"
                    f"MemAvailable:   {kb(available)} kB\nBuffers:           52776 kB\n"
                    f"Cached:         {kb(available - free)} kB\n")
    return path


def _no_cgroup(tmp_path: Path) -> dict:
    return dict(cgroup_root=tmp_path / "no-cgroup", proc_cgroup=tmp_path / "no-cgroup-file")


def test_the_cpu_budget_is_memavailable_not_memfree(tmp_path):
    """MemFree 0.1 GiB beside MemAvailable 12 GiB (a page cache of 11.9 GiB): the budget is MemAvailable less
    the 1 GiB margin, where the free pages gave -0.9 GiB; 8 CPU devices of one process share it."""
    meminfo = _meminfo(tmp_path / "meminfo", total=16, free=0.1, available=12)
    available, what = host_available_memory(meminfo, **_no_cgroup(tmp_path))
    assert available == 12 * GIB and what == "MemAvailable 12.00 GiB of MemTotal 16.00 GiB"
    cpu = jax.devices("cpu")[0]
    budget, source = default_memory_budget(cpu, host=(available, what))
    assert budget == 11 * GIB and source.startswith("host available memory: MemAvailable 12.00 GiB")
    shared, source = default_memory_budget(cpu, sharing=8, host=(available, what))
    assert shared == 11 * GIB // 8 and source.endswith("split over 8 CPU devices")


def test_a_cgroup_limit_caps_the_host_memory(tmp_path):
    """A container's cgroup allows less than the host has: its limit less what it uses (its inactive page cache,
    which the kernel drops first, not counted), in cgroup v2 and v1."""
    meminfo = _meminfo(tmp_path / "meminfo", total=64, free=1, available=60)
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "memory.max").write_text(f"{8 * GIB}\n")
    (v2 / "job" / "memory.current").write_text(f"{5 * GIB}\n")
    (v2 / "job" / "memory.stat").write_text(f"anon {2 * GIB}\ninactive_file {2 * GIB}\nactive_file {GIB}\n")
    (tmp_path / "cgroup2").write_text("0::/job\n")
    available, what = host_available_memory(meminfo, v2, tmp_path / "cgroup2")
    assert available == 5 * GIB and what.startswith("cgroup limit 8.00 GiB less 3.00 GiB in use; MemAvailable 60")
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)  # the process's group is not mounted (a container): the mount's root holds the limit
    (v1 / "memory.limit_in_bytes").write_text(f"{4 * GIB}\n")
    (v1 / "memory.usage_in_bytes").write_text(f"{3 * GIB}\n")
    (v1 / "memory.stat").write_text(f"cache {2 * GIB}\ntotal_inactive_file {GIB}\n")
    (tmp_path / "cgroup1").write_text("5:devices:/\n4:memory:/process_api/abc\n0::/\n")
    assert host_available_memory(meminfo, tmp_path / "v1", tmp_path / "cgroup1")[0] == 2 * GIB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert host_available_memory(meminfo, tmp_path / "v1", tmp_path / "cgroup1")[0] == 60 * GIB


def _batch(vocab: int, b: int = 2, t: int = 128) -> dict[str, np.ndarray]:
    """[b, t] rows of two documents, loss on their next tokens."""
    ids = np.random.default_rng(0).integers(0, vocab, (b, t)).astype(np.int32)
    seg = np.repeat(np.concatenate([np.full(t // 2, 1), np.full(t - t // 2, 2)])[None], b, 0).astype(np.int32)
    pos = np.repeat(np.concatenate([np.arange(t // 2), np.arange(t - t // 2)])[None], b, 0).astype(np.int32)
    mask = (np.roll(seg, -1, 1) == seg).astype(np.float32)
    mask[:, -1] = 0
    return dict(input_ids=ids, targets=np.roll(ids, -1, 1), loss_mask=mask, segment_ids=seg, positions=pos)


def _run_on_host(model_dir: Path, meminfo: Path, tmp_path: Path) -> Run:
    """A `remat: auto` run with the default budget, on a host whose memory reads as `meminfo` says."""

    class OnHost(Run):
        def _host_memory(self):
            return host_available_memory(meminfo, **_no_cgroup(tmp_path))

    return OnHost(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32",
                  execution=ExecutionConfig(attention_implementation="reference", remat="auto"))


def test_remat_auto_trains_where_memfree_is_far_below_memavailable(model_dir, tmp_path):
    """The host of the report: free pages below the step's estimate, gigabytes available. auto plans in
    MemAvailable, chooses no remat and the step trains; no host-offloading candidate is offered on a CPU."""
    meminfo = _meminfo(tmp_path / "meminfo", total=16, free=0.01, available=12)
    run, lines = _run_on_host(model_dir, meminfo, tmp_path), []
    batch = _batch(run.model_config.vocab_size)
    assert run.choose_remat(batch, log=lines.append) == "none"
    assert lines[0].startswith("remat auto: device budget 11.00 GiB (host available memory: MemAvailable 12.00 GiB")
    assert "offload" not in lines[0].split("candidates in order of expected speed: ")[1].split(" (")[0]
    assert lines[1].endswith("fits: chosen")
    run.load()
    assert np.isfinite(float(run.step(batch, 0)["loss"]))


def test_a_default_budget_nothing_fits_refuses_in_one_line_without_host_candidates(model_dir, tmp_path):
    """Available memory just over the margin: a positive budget above the weights that no candidate fits. Only
    candidates that keep everything in the device's memory are compiled (no offload, no streamed weights: the
    device is the host), and the refusal names the memory it read and what to do, not a key never written."""
    run = _run_on_host(model_dir, tmp_path / "meminfo", tmp_path)
    weights = run.streamed_weight_bytes()
    _meminfo(tmp_path / "meminfo", total=16, free=0.01, available=1 + 1.5 * weights / GIB)
    with pytest.raises(MemoryBudgetError) as info:
        run.choose_remat(_batch(run.model_config.vocab_size), log=lambda line: None)
    assert run.remat_estimates and all(not parse(name.split(" on ")[0]).offloads and STREAMED not in name
                                       for name in run.remat_estimates)
    text = str(info.value)
    assert text.startswith("no remat policy fits in ") and "(host available memory: MemAvailable 1.00 GiB" in text
    assert "set max_memory_gb" in text and "\n" not in text and info.value.field == "max_memory_gb"


def test_a_default_budget_below_zero_refuses_before_compiling(model_dir, tmp_path):
    """Less available than the margin: nothing can fit, said at once (no candidate compiled) with the numbers."""
    run = _run_on_host(model_dir, _meminfo(tmp_path / "meminfo", total=16, free=0.01, available=0.5), tmp_path)
    with pytest.raises(MemoryBudgetError) as info:
        run.choose_remat(_batch(run.model_config.vocab_size), log=lambda line: None)
    assert run.remat_compiles == [] and run.remat_estimates == {}
    assert str(info.value).startswith("the memory left for the step is -0.500 GiB per device (host available "
                                      "memory: MemAvailable 0.50 GiB of MemTotal 16.00 GiB, less max(1 GiB, 5%))")
