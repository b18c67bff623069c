"""experiments/kernels/grouped_matmul_bench.py (the grouped matmul's sweeps, probes and A/B against another tree):
its tile candidates fit and lower for a GPU from the CPU, and the sweep, the probe and the A/B run end to end in
the interpreter on a small shape."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

from experiments.kernels import grouped_matmul_bench as bench


def test_two_block_candidates_fit_an_sm_and_lower_for_a_gpu_from_the_cpu():
    """Every several-blocks-an-SM candidate of the sweep fits its blocks in an SM's shared memory, and goes through
    Mosaic GPU's CUDA lowering on the Qwen3-30B-A3B shapes (forward and d lhs row kernels, d rhs)."""
    from kernels_pallas.grouped_matmul import tiles
    from kernels_pallas.grouped_matmul.mosaic_drhs import gmm_drhs
    from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows

    lowered = 0
    for k, n in [(768, 2048), (2048, 1536)]:
        lhs, dout = jax.ShapeDtypeStruct((4096, k), jnp.bfloat16), jax.ShapeDtypeStruct((4096, n), jnp.bfloat16)
        rhs, sizes = jax.ShapeDtypeStruct((128, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((128,), jnp.int32)
        jobs = [(cfg, lambda a, b, c, cfg=cfg: gmm_rows(a, b, c, cfg), (lhs, rhs, sizes))
                for cfg in bench.two_block_candidates(k, n)]
        jobs += [(cfg, lambda a, b, c, cfg=cfg: gmm_rows(a, b, c, cfg, transpose_rhs=True), (dout, rhs, sizes))
                 for cfg in bench.two_block_candidates(n, k)]
        jobs += [(cfg, lambda a, d, c, cfg=cfg: gmm_drhs(a, d, c, cfg), (lhs, dout, sizes))
                 for cfg in bench.multi_block_dw_candidates(k, n)]
        for cfg, fn, args in jobs:
            row_kernel = cfg.blocks_per_sm > 1
            assert row_kernel != (cfg.dw_blocks_per_sm > 1)
            assert tiles.blocks_fit(tiles.smem_bytes(cfg), 2) if row_kernel else \
                tiles.blocks_fit(tiles.drhs_smem_bytes(cfg), cfg.dw_blocks_per_sm)
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
            lowered += 1
    assert lowered == 2 + 3 + 3 + 3 + 2 + 5  # down: fwd, d lhs, d rhs; gate_up: the same
    assert not tiles.blocks_fit(tiles.smem_bytes(tiles.TileConfig(block_n=192, stages=4)), 2)


def test_sweep_candidates_lower_for_a_gpu_from_the_cpu():
    """Every 256-row candidate of the sweep (split along M, 128 rows a compute warpgroup) through Mosaic GPU's CUDA
    lowering, forward and d lhs, on the shapes that offer one: the sweep times them on the H200, where a config
    the lowering rejects would only print its error."""
    from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows_ws

    lowered = 0
    for k, n, g in [(768, 2048, 128), (2048, 1536, 128), (2880, 5760, 32)]:
        lhs, dout = jax.ShapeDtypeStruct((4096, k), jnp.bfloat16), jax.ShapeDtypeStruct((4096, n), jnp.bfloat16)
        rhs, sizes = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32)
        for cfg in [c for c in bench.sweep_candidates(k, n) if c.block_m == 256]:
            for a, transpose in ((lhs, False), (dout, True)):
                fn = jax.jit(lambda a, b, c: gmm_rows_ws(a, b, c, cfg, transpose_rhs=transpose))
                text = fn.trace(a, rhs, sizes).lower(lowering_platforms=("cuda",)).as_text()
                assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
                lowered += 1
    assert lowered == 3 * 2 * 2  # two walks a shape, forward and d lhs


def test_bench_against_another_tree_alternates_and_reports_both(tmp_path):
    """The A/B mode of the bench (`--against`): another tree's kernels load beside this tree's, both run in every
    round, and each version reports its per-round times (here the same tree twice, in the interpreter)."""
    from kernels_pallas.grouped_matmul import mosaic

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    other = bench.load_kernels(root)
    assert other is not mosaic and other.grouped_matmul_mosaic is not mosaic.grouped_matmul_mosaic
    # Its kernels and tiles are the other tree's too, not this tree's under another name.
    assert other.gmm_rows.__module__ == "grouped_matmul_against.mosaic_kernels"
    assert other.config_for.__module__ == "grouped_matmul_against.tiles"
    out = tmp_path / "ab.json"
    rows = bench.main(["--smoke", "--against", root, "--rounds", "2", "--iters", "1", "--json", str(out)])
    assert [r["version"] for r in rows] == ["this", "against"]
    for r in rows:
        assert len(r["fwd_ms_rounds"]) == len(r["fwd_bwd_ms_rounds"]) == 2
        assert r["fwd_ms"] in r["fwd_ms_rounds"] and r["fwd_tflops"] > 0
    assert json.loads(out.read_text())["rows"] == rows
    with pytest.raises(SystemExit, match="no .*mosaic.py; export a tree there first"):
        bench.load_kernels(str(tmp_path))


def test_sweep_candidates_fit_and_the_sweep_reports_each_config():
    """The tile sweep (`bench --sweep`): every candidate divides the width (no padded copy of the experts), chains
    (its stages divide the contraction steps) and fits in shared memory, both walks are offered; and the sweep,
    here in the interpreter on a small shape, times the table's config and each candidate given, per direction."""
    from kernels_pallas.grouped_matmul import mosaic, tiles
    from kernels_pallas.grouped_matmul.shapes import GmmShape, ragged_sizes

    for kc, n in [(2048, 1536), (768, 2048), (2880, 5760), (5760, 2880)]:
        cands = bench.sweep_candidates(kc, n)
        assert cands and all(c.warp_specialized and c.chained for c in cands)
        for c in cands:
            assert n % c.cta_n == 0 and (kc // c.block_k) % c.stages == 0
            assert tiles.smem_bytes(c) <= tiles._SMEM_BYTES
        assert {c.grid_block_n for c in cands} == {0, 1}
    shape = GmmShape("s", ragged_sizes(120, 3), 128, 128, 128, "bfloat16")
    small = lambda kc, n: [tiles.TileConfig(block_m=64, block_n=64, block_k=64, stages=2, warp_specialized=True,
                                             wg_split="m", grid_block_n=2)]
    small_dw = lambda k, n: [tiles.TileConfig(dw_block_k=64, dw_block_n=64, dw_block_t=64, dw_stages=2)]
    rows = bench.run_sweep([shape], iters=1, compile_threads=2, candidates=small, dw_candidates=small_dw,
                          timing_rounds=1)
    # per row-kernel direction: the table's config, it with the other walk, the candidate; the forward and the d lhs
    # with an adapter, fused and as two kernels (the table's: the one the GPU runs, per mosaic's FUSED_* flags);
    # d rhs: table, the several-blocks candidates, candidate
    fwd, dlhs = mosaic.FUSED_LORA_ON_GPU, mosaic.FUSED_DLHS_LORA_ON_GPU
    # per row-kernel direction also the two-blocks-an-SM tiles (`two_block_candidates`: one at 128 x 128), and for
    # d rhs `multi_block_dw_candidates`' two (two and three blocks)
    assert [(r["direction"], r["table"]) for r in rows] == [("fwd", True)] + [("fwd", False)] * 3 + [
        ("dlhs", True)] + [("dlhs", False)] * 3 + [("fwd+lora", fwd), ("fwd+lora", not fwd), ("dlhs+lora", dlhs),
                                                   ("dlhs+lora", not dlhs), ("drhs", True)] + [("drhs", False)] * 3
    assert rows[8]["label"].startswith("fused ") and rows[9]["label"].startswith("two kernels ")
    assert rows[10]["label"].startswith("fused ") and rows[11]["label"].startswith("two kernels ")
    assert rows[2]["label"] == rows[6]["label"] == "single 128x128x64 st3 walkrow x2/SM"
    assert [r["label"] for r in rows[-3:]] == ["drhs 128x128 t64 st3 x2/SM", "drhs 128x128 t64 st2 x3/SM",
                                               "drhs 64x64 t64 st2"]
    assert all(bench.sweep_dw_candidates(2880, 5760)) and all(
        2880 % c.dw_block_k == 0 and 5760 % c.dw_block_n == 0 for c in bench.sweep_dw_candidates(2880, 5760))
    assert all(r["tflops"] > 0 and "error" not in r for r in rows)
    assert rows[3]["label"] == "ws-m 64x64x64 st2 walk2" and rows[3]["config"]["grid_block_n"] == 2
    # every other config computes the table's product (bf16 outputs of ~N(0, 128) entries: a rounding step or two
    # where the accumulation order differs, as the adapter's two kernels round twice)
    others = [r for r in rows if not r["table"]]
    assert others and all(r["max_abs_diff_vs_table"] <= 0.5 for r in others)
    assert all("max_abs_diff_vs_table" not in r for r in rows if r["table"])
    table = tiles.TileConfig(warp_specialized=True, wg_split="n", stages=3)
    assert [bench._describe(c) for c in bench._table_variants(table)] == [
        "ws-n 128x128x64 st3 walkrow", "ws-n-unchained 128x128x64 st3 walkrow", "ws-n 128x128x64 st3 walk1"]


def test_probe_variants_are_typed_tile_fields_or_one_line(capsys):
    """`--probe-variant FIELD=VALUE[,...]`: each value typed as its TileConfig field; an unknown field, a value of
    the wrong type, or the flag without --probe is one line naming the flag."""
    import argparse


    ap = argparse.ArgumentParser()
    assert bench._tile_fields(ap, "stages=4,chained=0,wg_split=m") == {"stages": 4, "chained": False,
                                                                      "wg_split": "m"}
    for bad, said in (("depth=4", "expected FIELD=VALUE with FIELD one of"),
                      ("stages=x", "stages is a TileConfig int"), ("stages", "expected FIELD=VALUE")):
        with pytest.raises(SystemExit):
            bench._tile_fields(ap, bad)
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--probe-variant", "stages=2"])
    assert "--probe-variant adds kernels to --probe; add --probe" in capsys.readouterr().err


def test_table_variants_without_a_sweep_is_one_line(capsys):
    """`bench --table-variants` only narrows `--sweep`: alone it names the missing flag instead of running the bench."""

    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--table-variants"])
    assert exit_info.value.code == 2
    assert "--table-variants narrows --sweep; add --sweep" in capsys.readouterr().err


def test_table_variants_sweep_times_the_row_kernels_only(tmp_path):
    """`bench --sweep --table-variants` (in the interpreter on the smoke shape): the table's row-kernel configs, their
    variants and the adapter rows, and no d rhs row, as its help says."""

    rows = bench.main(["--smoke", "--sweep", "--table-variants", "--iters", "1", "--timing-rounds", "1",
                       "--json", str(tmp_path / "sweep.json")])
    directions = {r["direction"] for r in rows}
    assert directions == {"fwd", "dlhs", "fwd+lora", "dlhs+lora"}
    assert [r["table"] for r in rows if r["direction"] == "fwd"][0] and all("error" not in r for r in rows)
    assert json.loads((tmp_path / "sweep.json").read_text())["rows"] == rows


def test_probe_problems_keep_the_rows_and_vary_groups_or_contraction():
    """`probe_problems` of a 128-group shape: every problem has the shape's rows and N; equal groups, 32 and 8 equal
    groups (the same rows over fewer expert matrices) and one group, then K x2 and x4 on the 128 equal groups; a
    shape of 3 groups gets no fewer-groups problems."""
    from kernels_pallas.grouped_matmul.shapes import BENCH_SHAPES

    shape = next(s for s in BENCH_SHAPES if s.name == "qwen3_30b_a3b_down")
    problems = bench.probe_problems(shape)
    assert [label for label, _ in problems] == ["as is", "equal groups", "32 equal groups", "8 equal groups",
                                                "one group", "equal groups, K x2", "equal groups, K x4"]
    for label, p in problems:
        assert sum(p.group_sizes) == shape.m and p.n == shape.n, label
    assert [len(p.group_sizes) for _, p in problems] == [128, 128, 32, 8, 1, 128, 128]
    assert all(len(set(p.group_sizes)) == 1 for label, p in problems[1:]), "equal sizes"
    assert [p.k // shape.k for _, p in problems] == [1, 1, 1, 1, 1, 2, 4]
    small = bench.probe_problems(dataclasses.replace(shape, group_sizes=(70, 0, 186)))
    assert [label for label, _ in small] == ["as is", "equal groups", "one group", "equal groups, K x2",
                                             "equal groups, K x4"]


def test_probe_jax_dense_rows_lower_for_a_gpu_from_the_cpu():
    """The probe's one-group rows of JAX's own dense Mosaic GPU matmul (`bench._JAX_DENSE`, GPU only when timed):
    each config, clusters included, lowers for CUDA from the CPU to one Mosaic GPU call, under an abstract mesh that
    gives the example its SM count (it asks the default device, which a CPU cannot answer)."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh


    lhs, rhs = jax.ShapeDtypeStruct((65536, 768), jnp.bfloat16), jax.ShapeDtypeStruct((768, 2048), jnp.bfloat16)
    programs = bench._jax_dense_programs(lhs, rhs)
    assert len(programs) == len(bench._JAX_DENSE) and all(label.startswith("jax example") for label in programs)
    mesh = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                                                     num_cores=132, platform="cuda"))
    with use_abstract_mesh(mesh):
        for label, (cfg, config, fn, args, grouped) in programs.items():
            assert cfg is None and config == label and grouped
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("stablehlo.custom_call @mosaic_gpu") == 1, label


def test_probe_runs_the_table_kernel_on_each_derived_problem():
    """`bench --probe`: the shape as it is, in equal groups, as one group, and with K x2 / x4, each on the original
    shape's table tiles (also with a variant, and reading the experts stored transposed) beside dense XLA; every
    kernel output equals the reference, and the units it walks are counted (equal groups of a multiple of the tile:
    no partial tile, so units = rows / block_m x N-blocks)."""
    from kernels_pallas.grouped_matmul import tiles
    from kernels_pallas.grouped_matmul.shapes import GmmShape

    shape = GmmShape("p", (70, 0, 186), 256, 64, 128, "bfloat16")
    rows = bench.run_probe([shape], iters=1, timing_rounds=1, variants=[{"warp_specialized": True, "chained": False}])
    labels = ["as is", "equal groups", "one group", "equal groups, K x2", "equal groups, K x4"]
    impls = ("mosaic", "mosaic variant 1", "mosaic rhs [G, N, K]", "dense")
    assert [(r["problem"], r["impl"]) for r in rows] == [(p, i) for p in labels for i in impls]
    assert all("error" not in r and r["tflops"] > 0 for r in rows)
    mosaic_rows = {r["problem"]: r for r in rows if r["impl"] == "mosaic"}
    cfg = tiles.config_for(64, 128, 3)
    assert [r["config"] for r in rows[:4]] == [bench._describe(cfg), bench._describe(dataclasses.replace(
        cfg, warp_specialized=True, chained=False)), bench._describe(cfg) + " rhs^T", "xla"]
    assert all(r["max_abs_diff"] < 0.5 for r in rows if r["impl"] in ("mosaic variant 1", "mosaic rhs [G, N, K]"))
    assert [mosaic_rows[p]["k"] for p in labels] == [64, 64, 64, 128, 256]
    assert [mosaic_rows[p]["k_steps"] for p in labels] == [1, 1, 1, 2, 4]
    # (one N-block of 128) as is: 70 rows in one tile, 186 from row 70 loaded from row 64 in two; equal groups: three
    # of 85 rows, a tile each, and the row left over past them (the pseudo-group's tile); one group: 256 / 128
    assert [mosaic_rows[p]["units"] for p in labels] == [3, 4, 2, 4, 4]
    assert all(r["max_abs_diff"] < 0.5 for r in mosaic_rows.values())
    assert all(r["us_per_unit"] > 0 for r in mosaic_rows.values())


def test_queued_timing_queues_the_calls_and_synchronises_once_per_round():
    """`queued_ms`: warm-up calls, then `rounds` x `reps` calls; per round the device is
    synchronised once, on the last call's output, and the reported time is the median round's time per call."""
    calls, synced = [], []

    class Out:  # stands for a device array: records when the timer waits on it
        def __init__(self, i):
            self.i = i

        def block_until_ready(self):
            synced.append(self.i)
            return self

    def program(x):
        calls.append(x)
        return Out(len(calls))

    ms = bench.queued_ms(program, (1,), reps=4, rounds=3, warmup=2)
    assert len(calls) == 2 + 3 * 4 and ms > 0
    assert synced == [1, 2, 6, 10, 14]  # each warm-up call, then only the last call of each round
    with pytest.raises(ValueError, match="need reps, rounds >= 1"):
        bench.queued_ms(program, (1,), reps=0)
