"""Grouped matmul (kernels_pallas/grouped_matmul): every implementation against a dense per-group loop.

The oracle here is independent of the op's code: numpy in float64, one plain matmul per group over that
group's rows (lhs_g @ rhs[g]; d lhs_g = dout_g rhs[g]^T; d rhs[g] = lhs_g^T dout_g), zeros for rows past the
last group and for empty groups' rhs gradients. Shapes (shapes.TEST_SHAPES) have empty groups first, in the
middle and last, and rows left over.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.grouped_matmul import OP, grouped_matmul
from kernels_pallas.grouped_matmul.api import GPU_FIRST
from kernels_pallas.grouped_matmul.shapes import TEST_SHAPES, make_inputs
from kernel_helpers import jitted_vjp

TOL = {"float32": 2e-5, "bfloat16": 3e-2}


def _loop(lhs, rhs, sizes, dout):
    lhs, rhs, dout = (np.asarray(a, np.float64) for a in (lhs, rhs, dout))
    out, dlhs, drhs = np.zeros((lhs.shape[0], rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(np.asarray(sizes)):
        rows = slice(start, start + int(size))
        out[rows] = lhs[rows] @ rhs[g]
        dlhs[rows] = dout[rows] @ rhs[g].T
        drhs[g] = lhs[rows].T @ dout[rows]
        start += int(size)
    return out, dlhs, drhs


def _close(got, want, dtype, what):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    scale = max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got - want)))
    assert err <= TOL[dtype] * scale, f"{what}: max |err| {err:.3g} > {TOL[dtype]} * {scale:.3g}"


# Mosaic GPU's interpreter runs every tile of a call in Python (a call costs seconds however often it recurs): the
# kernels take the first shape here (empty groups first, in the middle and last); rows past the last group, longer
# contraction and more tiles are the adapter and row-kernel tests' below.
_PER_SHAPE = [(impl, shape) for impl in OP.names for shape in TEST_SHAPES
              if impl != "pallas_mosaic" or shape is TEST_SHAPES[0]]


@pytest.mark.parametrize("impl,shape", _PER_SHAPE, ids=[f"{s.name}-{i}" for i, s in _PER_SHAPE])
def test_forward_and_gradients_match_a_per_group_loop(impl, shape):
    lhs, rhs, sizes, dout = make_inputs(shape)
    out, dlhs, drhs = jitted_vjp(lambda l, r: grouped_matmul(l, r, sizes, implementation=impl), dout, lhs, rhs)
    want_out, want_dlhs, want_drhs = _loop(lhs, rhs, sizes, dout)
    assert out.shape == want_out.shape and out.dtype == lhs.dtype
    _close(out, want_out, shape.dtype, "out")
    _close(dlhs, want_dlhs, shape.dtype, "d lhs")
    _close(drhs, want_drhs, shape.dtype, "d rhs")
    # Empty groups get exactly zero rhs gradient, rows past the last group exactly zero output and d lhs.
    empty = np.asarray(sizes) == 0
    assert not np.any(np.asarray(drhs, np.float32)[empty])
    used = int(np.sum(np.asarray(sizes)))
    assert not np.any(np.asarray(out, np.float32)[used:]) and not np.any(np.asarray(dlhs, np.float32)[used:])


@pytest.mark.parametrize("impl", OP.names)
def test_group_sizes_are_traced_one_program_serves_every_split(impl):
    shape = TEST_SHAPES[0]
    lhs, rhs, _, dout = make_inputs(shape)
    fn = jax.jit(lambda l, r, s: grouped_matmul(l, r, s, implementation=impl))
    splits = ((15, 0, 0, 0, 0, 0), (15, 0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 15), (2, 3, 0, 4, 1, 5))
    for i, sizes in enumerate(splits):
        s = jnp.asarray(sizes, jnp.int32)
        _close(fn(lhs, rhs, s), _loop(lhs, rhs, s, dout)[0], shape.dtype, f"out for sizes {sizes}")
        if i == 1:
            # The first split twice: in a fresh process the Mosaic GPU interpreter's first run adds a value to JAX's
            # tracing context (explain_cache_misses: 50 -> 51), which retraces the same split once; that is not the
            # group sizes, which must not add programs after it.
            programs = fn._cache_size()
    assert programs <= 2 and fn._cache_size() == programs


def test_bad_shapes_are_one_line_naming_the_file():
    lhs, rhs, sizes, _ = make_inputs(TEST_SHAPES[0])
    with pytest.raises(ValueError, match=r"grouped_matmul/api.py: .*lhs \[M, K\] and rhs \[G, K, N\]"):
        grouped_matmul(lhs[:, :-1], rhs, sizes)
    with pytest.raises(ValueError, match=r"group_sizes must be integers of shape \(6,\)"):
        grouped_matmul(lhs, rhs, sizes[:-1])
    with pytest.raises(ValueError, match=r"same dtype"):
        grouped_matmul(lhs.astype(jnp.bfloat16), rhs, sizes)
    with pytest.raises(ValueError, match=r"grouped_matmul has no implementation='triton'"):
        grouped_matmul(lhs, rhs, sizes, implementation="triton")
    from kernels_pallas.grouped_matmul.tiles import TileConfig

    with pytest.raises(ValueError, match=r"tiles.py: TileConfig.dw_blocks_per_sm must be >= 1, got 0"):
        TileConfig(dw_blocks_per_sm=0)


# --------------------------------------------------------------------------- the Mosaic GPU kernels' schedule


@pytest.mark.parametrize("sizes,m,block_m", [((0, 5, 0, 1, 9, 0), 16, 8), ((70, 0, 61, 3, 0, 50), 192, 64),
                                             ((64, 64), 128, 64), ((0, 0, 0), 48, 16), ((1, 63, 64, 1), 192, 64),
                                             ((3,) * 20, 64, 64), ((5, 130, 3, 300, 75), 640, 128),
                                             ((13,) * 30, 512, 16)])
def test_row_tiles_cover_every_row_once_from_its_groups_first_row(sizes, m, block_m):
    from kernels_pallas.grouped_matmul.mosaic_kernels import num_row_tiles, row_tiles

    # jit'd: one program per case (op by op, every eager op of a new shape compiles on its own)
    tiles = jax.jit(row_tiles, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), m, block_m)
    group, row0, lo, hi = (np.asarray(a) for a in tiles)
    g = len(sizes)
    assert group.shape == (num_row_tiles(m, g, block_m),)
    ends = np.concatenate([np.cumsum(sizes), [m]])
    starts = np.concatenate([[0], ends[:-1]])
    owner = np.full(m, -1)
    for t in range(len(group)):
        if hi[t] == lo[t]:
            continue
        # the loaded block lies inside the array, starts at a multiple of 8 (Mosaic GPU) and holds the stored rows
        assert group[t] <= g and 0 <= row0[t] <= m - block_m and row0[t] % 8 == 0
        assert row0[t] <= lo[t] < hi[t] <= row0[t] + block_m
        assert starts[group[t]] <= lo[t] and hi[t] <= ends[group[t]]
        assert np.all(owner[lo[t]:hi[t]] == -1), f"tile {t} overlaps an earlier tile"
        owner[lo[t]:hi[t]] = group[t]
    want = np.repeat(np.arange(g + 1), np.diff(np.concatenate([[0], ends])))  # row -> group (g: past the end)
    np.testing.assert_array_equal(owner, want)
    # the work: one tile per started block_m rows of each group from its first row rounded down to 8, never more
    # than the global grid's tiles (one per block each group touches)
    aligned = sum(-(-(e - s + s % 8) // block_m) for s, e in zip(starts, ends) if e > s)
    grid = sum((e - 1) // block_m - s // block_m + 1 for s, e in zip(starts, ends) if e > s)
    assert np.sum(hi > lo) == aligned <= grid


@pytest.mark.parametrize("k,n", [(192, 16), (16, 192)])
def test_default_tiles_fit_the_widths_so_nothing_is_padded(k, n):
    """A rank-16 expert LoRA's shapes (K or N = 16 beside a width that is a multiple of 64 but not of 128, like
    GPT-OSS's 2880): the default tiles divide the wide side (no zero-padded copy of the operand). The kernels on
    those tiles against the per-group loop: test_grouped_matmul_gpu.py::test_default_tiles_of_a_rank_16_adapter_match
    (natively)."""
    from kernels_pallas.grouped_matmul.tiles import config_for, _dlhs_config

    cfg = config_for(k, n, 4)
    wide = max(k, n)  # the narrow side (16) is padded to one 64-wide tile: a copy of a rank-16 operand only
    assert wide % (cfg.dw_block_k if k == wide else cfg.block_n) == 0
    assert wide % (cfg.dw_block_k if k == wide else cfg.dw_block_n) == 0
    assert k == 16 or k % _dlhs_config(cfg, k, n, 4).block_n == 0
    assert config_for(2880, 16, 32).dw_block_k in (64, 192) and config_for(16, 2880, 32).block_n in (64, 192)


def test_auto_takes_the_kernels_only_on_hopper():
    import types

    from kernels_pallas.grouped_matmul.mosaic import grouped_matmul_mosaic

    assert OP.resolve("auto", "cpu").name == "xla" and OP.resolve(None, "cpu").name == "xla"
    mosaic = OP.get("pallas_mosaic")
    gpu = lambda cc: types.SimpleNamespace(platform="gpu", compute_capability=cc)
    assert mosaic.supported_on(gpu("9.0")) and not mosaic.supported_on(gpu("8.0"))
    assert not mosaic.supported_on("cpu") and mosaic.runs_on("cpu")  # interpret mode, by name only
    assert OP.default_for(gpu("9.0")) == "pallas_mosaic" and OP.default_for(gpu("8.6")) == "xla"
    assert GPU_FIRST[0] == "pallas_mosaic" and all(OP.get(name) for name in GPU_FIRST)
    lhs, rhs, sizes, _ = make_inputs(TEST_SHAPES[0])
    with pytest.raises(ValueError, match=r"grouped_matmul/mosaic.py: .*bfloat16/float16 operands, got float32"):
        grouped_matmul_mosaic(lhs, rhs, sizes, interpret=False)


# The warp-specialised row kernel in the interpreter: split along M, rhs as stored, in the chains below; split
# along N or M with an adapter, rhs as stored (test_row_kernels_fuse_the_adapter_on_every_variant) or read
# transposed (test_row_kernels_fuse_the_adapter_into_a_transposed_product). Without an adapter, each split forward
# and transposed: test_grouped_matmul_gpu.py::test_every_row_kernel_variant_forward_and_transposed (natively), 256-row
# tiles split along M: test_256_row_warp_specialised_tiles_split_along_m_match.


# One unit, START then STOP, the unchained fill-and-drain, the walks over the N-blocks and a tile moved back from
# the end: test_grouped_matmul_gpu.py::test_warp_specialised_chains_of_pipelines_match (natively).
@pytest.mark.parametrize("sizes,m,k,n,walk", [
    ((70, 0, 61, 3, 0, 50), 200, 128, 256, 0),  # 2 contraction steps = the 2 stages: chains of 7 units per "SM"
])
def test_warp_specialised_chains_of_pipelines_match_a_per_group_loop(sizes, m, k, n, walk):
    """The chained pipelines of the warp-specialised row kernel (TileConfig.chained) in interpret mode, on the
    interpreter's 2 "SMs": chains of several units (grid_block_n 0: a tile's whole row)."""
    from kernels_pallas.grouped_matmul.tiles import TileConfig
    from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows_ws

    cfg = TileConfig(block_m=64, block_n=64, block_k=64, stages=2, warp_specialized=True, wg_split="m",
                     grid_block_n=walk)
    k1, k2 = jax.random.split(jax.random.key(6))
    lhs = jax.random.normal(k1, (m, k), jnp.float32)
    rhs = jax.random.normal(k2, (len(sizes), k, n), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    got = gmm_rows_ws(lhs, rhs, sizes, cfg, interpret=True)
    _close(got, _loop(lhs, rhs, sizes, np.zeros((m, n)))[0], "float32", f"out (K {k}, N {n}, walk {walk})")


@pytest.mark.parametrize("impl", OP.names)
def test_a_row_of_a_layer_stack_equals_the_sliced_product(impl):
    """grouped_matmul(..., row=r) on a stack [L, G, K, N] is the product with rhs[r] (r traced: a jit argument),
    its d lhs that product's, and its d rhs the row's gradient with zeros on every other row."""
    shape = TEST_SHAPES[0]
    lhs, rhs, sizes, dout = make_inputs(shape)
    stack = jnp.stack([rhs * (i + 1) for i in range(3)])  # rows differ: a wrong row shows
    fn = jax.jit(lambda l, s, r: jax.vjp(lambda l, s: grouped_matmul(l, s, sizes, implementation=impl, row=r),
                                         l, s))
    for r in (2, 0):
        out, vjp = fn(lhs, stack, r)
        dlhs, dstack = vjp(dout)
        want_out, want_dlhs, want_drhs = _loop(lhs, stack[r], sizes, dout)
        _close(out, want_out, shape.dtype, f"out (row {r})")
        _close(dlhs, want_dlhs, shape.dtype, f"d lhs (row {r})")
        _close(dstack[r], want_drhs, shape.dtype, f"d rhs (row {r})")
        assert not np.any(np.asarray(np.delete(np.asarray(dstack, np.float32), r, axis=0)))
    with pytest.raises(ValueError, match=r"grouped_matmul/api.py: .*rhs \[L, G, K, N\] \(with row=\)"):
        grouped_matmul(lhs, rhs, sizes, implementation=impl, row=0)


# The single-warpgroup kernels' in-place read (forward and d lhs, through the custom VJP):
# test_a_row_of_a_layer_stack_equals_the_sliced_product[pallas_mosaic].
@pytest.mark.parametrize("ws", [True])
def test_row_kernels_read_the_stack_in_place_from_a_base(ws):
    """The row-tile kernels with `rhs_base` on a flattened stack [L * G, K, N] whose tiles need no padding read
    matrices base .. base + G - 1 of it (d lhs too), and with N needing padding fall back to the slice (the
    operands' code both kernels share: on one of them)."""
    from kernels_pallas.grouped_matmul.tiles import TileConfig
    from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows, gmm_rows_ws

    cfg = TileConfig(block_m=64, block_n=64, block_k=64, stages=2, warp_specialized=ws)
    kernel = gmm_rows_ws if ws else gmm_rows
    sizes = jnp.asarray((70, 0, 61, 3, 0, 50), jnp.int32)
    k1, k2 = jax.random.split(jax.random.key(5))
    lhs = jax.random.normal(k1, (200, 128), jnp.float32)
    for n in (128, 72) if ws else (128,):  # 72: N padded to the tiles, so the window is sliced out first
        stack = jax.random.normal(k2, (3 * 6, 128, n), jnp.float32)
        rhs = stack[12:18]
        got = kernel(lhs, stack, sizes, cfg, interpret=True, rhs_base=jnp.int32(12))
        _close(got, _loop(lhs, rhs, sizes, np.zeros((200, n)))[0], "float32", f"out from base 12 (N {n})")
        if n != 128:
            continue  # the slice fallback's d lhs: the same operand code as its forward
        dout = jax.random.normal(k1, (200, n), jnp.float32)
        got = kernel(dout, stack, sizes, cfg, transpose_rhs=True, interpret=True, rhs_base=jnp.int32(6))
        _close(got, _loop(dout, jnp.swapaxes(stack[6:12], 1, 2), sizes, np.zeros((200, 128)))[0], "float32",
               f"d lhs from base 6 (N {n})")


# One entry (split along N); the entries themselves run natively in test_grouped_matmul_gpu.py.
@pytest.mark.parametrize("key", [(768, 2048, 128)])
def test_table_variants_lower_for_a_gpu_from_the_cpu(key):
    """The Qwen3-30B-A3B warp-specialised entries and their sweep variants (unchained, the other walk) through Mosaic
    GPU's CUDA lowering, forward and (rhs read transposed) d lhs: an entry split along N and one along M (the third,
    (1536, 2048), lowers as a table shape and as the d lhs of (2048, 1536) in the next tests)."""
    from kernels_pallas.grouped_matmul import tiles
    from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows_ws

    kc, n, g = key
    table = tiles.CONFIGS[key]
    assert table.warp_specialized
    # the entry itself lowers forward in test_mosaic_kernels_lower_for_a_gpu_from_the_cpu; read transposed, as
    # its two variants here (which differ from it in the chaining and the walk only)
    variants = [dataclasses.replace(table, chained=False), dataclasses.replace(table, grid_block_n=1)]
    lhs, dout = jax.ShapeDtypeStruct((4096, kc), jnp.bfloat16), jax.ShapeDtypeStruct((4096, n), jnp.bfloat16)
    rhs, sizes = jax.ShapeDtypeStruct((g, kc, n), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32)
    for cfg in variants:
        for a, transpose in ((lhs, False), (dout, True)):
            fn = jax.jit(lambda a, b, c, cfg=cfg, t=transpose: gmm_rows_ws(a, b, c, cfg, transpose_rhs=t))
            text = fn.trace(a, rhs, sizes).lower(lowering_platforms=("cuda",)).as_text()
            assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


# rhs read transposed (d lhs) on two blocks an SM: test_grouped_matmul_gpu.py::test_two_blocks_an_sm_match
# (natively), the same units' split as the forward here.
@pytest.mark.parametrize("transpose", [False])
def test_two_blocks_an_sm_split_the_units_and_leave_the_products_unchanged(transpose):
    """TileConfig.blocks_per_sm / dw_blocks_per_sm = 2: the persistent grid has two blocks per "SM" (4 on the
    interpreter's 2), which split the units among them: the row kernel (forward, or rhs read transposed as d lhs)
    and the group-tile d rhs, on ragged groups with empty ones and rows past the last, equal to a per-group loop."""
    from kernels_pallas.grouped_matmul.mosaic_drhs import gmm_drhs
    from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows
    from kernels_pallas.grouped_matmul.tiles import TileConfig

    cfg = TileConfig(block_m=64, block_n=64, block_k=64, stages=2, blocks_per_sm=2, dw_block_k=64, dw_block_n=64,
                     dw_block_t=64, dw_stages=2, dw_blocks_per_sm=2)
    sizes = (70, 0, 61, 3, 0, 50)
    m, k, n = 200, 128, 128
    k1, k2, k3 = jax.random.split(jax.random.key(8), 3)
    lhs = jax.random.normal(k1, (m, k), jnp.float32)
    rhs = jax.random.normal(k2, (len(sizes), k, n), jnp.float32)
    dout = jax.random.normal(k3, (m, n), jnp.float32)
    want_out, want_dlhs, want_drhs = _loop(lhs, rhs, sizes, dout)
    sizes = jnp.asarray(sizes, jnp.int32)
    if transpose:  # d lhs: dout @ rhs[g]^T
        got = gmm_rows(dout, rhs, sizes, cfg, transpose_rhs=True, interpret=True)
        _close(got, want_dlhs, "float32", "d lhs, two blocks an SM")
    else:
        _close(gmm_rows(lhs, rhs, sizes, cfg, interpret=True), want_out, "float32", "out, two blocks an SM")
        _close(gmm_drhs(lhs, dout, sizes, cfg, interpret=True), want_drhs, "float32", "d rhs, two blocks an SM")


# A warp-specialised entry split along M (its d lhs: the (1536, 2048) entry, split along N; its d rhs two blocks an
# SM); the single-warpgroup kernels (forward plain and with an adapter, d lhs, the group-tile d rhs) lower on the
# (2880, 2880, 32) entry in test_an_adapter_on_the_products_own_rows_lowers_for_a_gpu_from_the_cpu. Every table
# entry runs natively in test_grouped_matmul_gpu.py::test_kernels_match_the_reference_on_ragged_moe_shapes.
@pytest.mark.parametrize("key", [(2048, 1536, 128)])
def test_mosaic_kernels_lower_for_a_gpu_from_the_cpu(key):
    """The GPU kernels (not the interpreter) through Mosaic GPU's lowering for a CUDA target, forward and both
    gradients. Why: the interpreter accepts what the GPU lowering rejects (a load from a
    row not proven a multiple of 8 failed layout inference on the H200 and passed every interpret-mode test)."""
    from kernels_pallas.grouped_matmul.mosaic import backward, forward

    k, n, g = key
    m = 4096
    lhs, dout = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    rhs, sizes = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16), jax.ShapeDtypeStruct((g,), jnp.int32)
    fwd = jax.jit(lambda a, b, c: forward(a, b, c, key)).trace(lhs, rhs, sizes).lower(lowering_platforms=("cuda",))
    bwd = jax.jit(lambda a, b, c, d: backward(a, b, c, d, key)).trace(lhs, rhs, sizes, dout).lower(
        lowering_platforms=("cuda",))
    calls = lambda lowered: lowered.as_text().count("stablehlo.custom_call @mosaic_gpu")  # noqa: E731
    assert calls(fwd) == 1
    assert calls(bwd) == 2  # d lhs (row tiles) and d rhs (group tiles)
    # a layer's experts read in place from a stack of 2 layers (the index array per tile), value and d lhs
    from kernels_pallas.grouped_matmul.mosaic import grouped_matmul_mosaic

    stack = jax.ShapeDtypeStruct((2, g, k, n), jnp.bfloat16)
    in_place = jax.jit(jax.value_and_grad(
        lambda a, b, c: grouped_matmul_mosaic(a, b, c, row=1, interpret=False).astype(jnp.float32).sum()))
    assert calls(in_place.trace(lhs, stack, sizes).lower(lowering_platforms=("cuda",))) == 2


def _lora_operands(m: int, k: int, n: int, g: int, r: int, seed: int):
    ks = jax.random.split(jax.random.key(seed), 5)
    return (jax.random.normal(ks[0], (m, k), jnp.float32), jax.random.normal(ks[1], (g, k, n), jnp.float32),
            jax.random.normal(ks[2], (m, r), jnp.float32), jax.random.normal(ks[3], (g, r, n), jnp.float32),
            jax.random.normal(ks[4], (m, n), jnp.float32))


def _lora_loop(lhs, rhs, xa, b, sizes, dout):
    """out = gmm(lhs, rhs) + gmm(xa, b) and its four gradients, from the per-group loop."""
    out, dlhs, drhs = _loop(lhs, rhs, sizes, dout)
    out_a, dxa, db = _loop(xa, b, sizes, dout)
    return out + out_a, dlhs, drhs, dxa, db


# pallas_mosaic on the stack only: the same custom VJP and kernels, reading the row in place (the in-place read vs
# the plain operand: test_row_kernels_read_the_stack_in_place_from_a_base); each interpreted kernel call costs
# seconds.
_STACKED = [(impl, stacked) for impl in OP.names for stacked in (False, True) if stacked or impl != "pallas_mosaic"]


@pytest.mark.parametrize("impl,stacked", _STACKED)
def test_a_fused_adapter_adds_its_product_and_gets_its_gradients(impl, stacked):
    """grouped_matmul(..., lora=(xa, b)) = gmm(lhs, rhs) + gmm(xa, b) with the gradients of both products, on every
    implementation (pallas_mosaic: the adapter's step in the kernel's accumulator, in the interpreter), with a rank
    (16) that the kernels pad to 64, ragged and empty groups and rows past the last group; with `row` on a stack."""
    sizes = jnp.asarray((70, 0, 61, 3, 0, 50), jnp.int32)
    lhs, rhs, xa, b, dout = _lora_operands(200, 128, 64, 6, 16, 7)
    stack = jnp.stack([rhs * 0.5, rhs])  # row 1 is rhs
    fn = (lambda l, w, x, bb: grouped_matmul(l, jnp.stack([w * 0.5, w]), sizes, implementation=impl, row=1,
                                             lora=(x, bb))) if stacked else \
        (lambda l, w, x, bb: grouped_matmul(l, w, sizes, implementation=impl, lora=(x, bb)))
    got = jitted_vjp(fn, dout, lhs, rhs, xa, b)
    out = got[0]
    for g, w, what in zip(got, _lora_loop(lhs, stack[1], xa, b, sizes, dout), ("out", "d lhs", "d rhs", "d xa", "d b")):
        _close(g, w, "float32", what)
    assert not np.any(np.asarray(out)[184:])  # rows past the groups: 0, adapter included


@pytest.mark.parametrize("ws,split,rank", [(False, "n", 8), (True, "n", 8), (True, "m", 80)])
def test_row_kernels_fuse_the_adapter_on_every_variant(ws, split, rank):
    """The fused adapter's step in each row kernel (single warpgroup; warp-specialised with the tile split along M
    or N, each compute warpgroup loading its own part of xa and b), chained over several units per "SM"; a rank
    past one 64-column tile (80, padded to 128)."""
    from kernels_pallas.grouped_matmul.tiles import TileConfig
    from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows, gmm_rows_ws

    cfg = TileConfig(block_m=64, block_n=64, block_k=64, stages=2, warp_specialized=ws, wg_split=split)
    sizes = jnp.asarray((70, 0, 61, 3, 0, 50), jnp.int32)
    lhs, rhs, xa, b, _ = _lora_operands(200, 128, 128, 6, rank, 8)
    got = (gmm_rows_ws if ws else gmm_rows)(lhs, rhs, sizes, cfg, interpret=True, lora=(xa, b))
    _close(got, _lora_loop(lhs, rhs, xa, b, sizes, np.zeros((200, 128)))[0], "float32", f"out ({ws}, {split})")


# The single-warpgroup kernel's transposed product with an adapter: the custom VJP's d lhs in
# test_an_adapter_on_the_products_own_rows_adds_its_product_and_gets_its_gradients[pallas_mosaic-True].
@pytest.mark.parametrize("ws,split", [(True, "m"), (True, "n")])
def test_row_kernels_fuse_the_adapter_into_a_transposed_product(ws, split):
    """The d lhs form with an adapter (`backward_lhs(lora=)`): out = lhs @ rhs[g]^T + xa @ b[g] (rhs [G, N, K]), on
    each row kernel variant; the output width (K = 128) and the adapter's b [G, r, K] come from the transposed side."""
    from kernels_pallas.grouped_matmul.tiles import TileConfig
    from kernels_pallas.grouped_matmul.mosaic_kernels import gmm_rows, gmm_rows_ws

    cfg = TileConfig(block_m=64, block_n=64, block_k=64, stages=2, warp_specialized=ws, wg_split=split)
    sizes = jnp.asarray((70, 0, 61, 3, 0, 50), jnp.int32)
    dout, rhs, dxa, at, _ = _lora_operands(200, 64, 128, 6, 16, 9)  # rhs [G, 64, 128]: read as [G, 128, 64]^T
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    got = (gmm_rows_ws if ws else gmm_rows)(dout, rhs_t, sizes, cfg, interpret=True, transpose_rhs=True,
                                           lora=(dxa, at))
    _close(got, _lora_loop(dout, rhs, dxa, at, sizes, np.zeros((200, 128)))[0], "float32", f"d lhs ({ws}, {split})")


def _adapted_reference(lhs, rhs, a, b, sizes):
    """gmm(lhs, rhs) + gmm(gmm(lhs, a), b) by the masked dense definition, differentiated by autodiff."""
    ref = lambda x, w: grouped_matmul(x, w, sizes, implementation="reference")  # noqa: E731
    return ref(lhs, rhs) + ref(ref(lhs, a), b)


@pytest.mark.parametrize("impl,stacked", _STACKED)
def test_an_adapter_on_the_products_own_rows_adds_its_product_and_gets_its_gradients(impl, stacked):
    """grouped_matmul(..., adapter=(a, b)) = gmm(lhs, rhs) + gmm(gmm(lhs, a), b) (the experts' down projection with
    its adapter) with the gradients of lhs (through both paths), rhs, a and b, against the definition's autodiff; on
    pallas_mosaic one custom VJP whose d lhs kernel adds d xa @ a^T in its accumulator (the interpreter). Ragged
    and empty groups, rows past the last group, a rank (16) the kernels pad to 64; with `row` on a stack."""
    sizes = jnp.asarray((70, 0, 61, 3, 0, 50), jnp.int32)
    lhs, rhs, _, b, dout = _lora_operands(200, 128, 64, 6, 16, 7)
    a = jax.random.normal(jax.random.key(11), (6, 128, 16), jnp.float32) / 8
    if stacked:
        fn = lambda l, w, aa, bb: grouped_matmul(l, jnp.stack([w * 0.5, w]), sizes,  # noqa: E731
                                                 implementation=impl, row=1, adapter=(aa, bb))
    else:
        fn = lambda l, w, aa, bb: grouped_matmul(l, w, sizes, implementation=impl, adapter=(aa, bb))  # noqa: E731
    got = jitted_vjp(fn, dout, lhs, rhs, a, b)
    out = got[0]
    for g, w, what in zip(got, jitted_vjp(lambda *p: _adapted_reference(*p, sizes), dout, lhs, rhs, a, b),
                          ("out", "d lhs", "d rhs", "d a", "d b")):
        _close(g, np.asarray(w, np.float64), "float32", what)
        assert float(jnp.max(jnp.abs(w))) > 0, what  # every gradient is a real one
    assert not np.any(np.asarray(out)[184:])  # rows past the groups: 0, adapter included


def test_an_adapter_with_both_or_bad_factors_is_one_line():
    sizes = jnp.asarray((2, 2), jnp.int32)
    lhs, rhs = jnp.zeros((4, 8)), jnp.zeros((2, 8, 6))
    with pytest.raises(ValueError, match=r"^kernels_pallas/grouped_matmul/api.py: grouped_matmul takes lora"):
        grouped_matmul(lhs, rhs, sizes, lora=(jnp.zeros((4, 2)), jnp.zeros((2, 2, 6))),
                       adapter=(jnp.zeros((2, 8, 2)), jnp.zeros((2, 2, 6))))
    with pytest.raises(ValueError, match=r"adapter=\(a, b\) needs a \[G, K, r\] and b \[G, r, N\]"):
        grouped_matmul(lhs, rhs, sizes, adapter=(jnp.zeros((2, 6, 2)), jnp.zeros((2, 2, 6))))


def test_fused_adapter_tiles_fit_shared_memory_or_fall_back():
    """`fused_config`: the table's tiles when the adapter's fit beside them, else a shallower ring (or 64-deep steps)
    whose stages still divide the contraction steps, else None (a second kernel); `smem_bytes` is what Mosaic GPU
    reported for the Qwen3-MoE gate_up tiles with the adapter (278,576 B with 48 B of barriers) before the fallback
    existed."""
    from kernels_pallas.grouped_matmul.tiles import config_for, fused_config, _SMEM_BYTES, smem_bytes

    qwen_gate_up = config_for(2048, 1536, 128)
    assert smem_bytes(qwen_gate_up, 16) + 48 == 278576
    fitted = fused_config(qwen_gate_up, 2048, 16)  # 2 stages already: 64-deep steps instead of 128
    assert (fitted.block_k, fitted.stages) == (64, 2) and smem_bytes(fitted, 16) <= _SMEM_BYTES
    assert fused_config(dataclasses.replace(qwen_gate_up, block_k=64, block_n=256), 2048, 16) is None
    qwen = fused_config(config_for(2048, 768, 128), 2048, 16)
    assert qwen.stages == 2 and (2048 // qwen.block_k) % 2 == 0 and smem_bytes(qwen, 16) <= _SMEM_BYTES
    gpt = config_for(2880, 5760, 32)
    assert fused_config(gpt, 2880, 16) == gpt  # fits as it is
    # a rank of 128 (two 64-column tiles) needs more: the GPT-OSS tiles then take a shallower ring
    assert smem_bytes(gpt, 128) > smem_bytes(gpt, 64) == smem_bytes(gpt, 16)
    assert fused_config(gpt, 2880, 128).stages < gpt.stages
    # two blocks an SM (GPT-OSS-20B down's tiles in 2 stages, a sweep candidate) stay two only if they fit the SM
    # with the adapter's tiles; else one block, its ring as deep as the two blocks' shared memory allows (4 stages)
    from kernels_pallas.grouped_matmul.tiles import blocks_fit

    down = dataclasses.replace(config_for(2880, 2880, 32), stages=2, blocks_per_sm=2)
    assert blocks_fit(smem_bytes(down), 2) and not blocks_fit(smem_bytes(down, 16), 2)
    alone = fused_config(down, 2880, 16)
    assert (alone.blocks_per_sm, alone.stages) == (1, 4) and smem_bytes(alone, 16) <= _SMEM_BYTES
    small = dataclasses.replace(down, block_n=64, block_m=64)
    assert blocks_fit(smem_bytes(small, 16), 2) and fused_config(small, 2880, 16) == small


# A warp-specialised entry whose tiles take the shallower ring with the adapter (the other such entry, (2048, 768,
# 128): its tiles in test_fused_adapter_tiles_fit_shared_memory_or_fall_back). A single-warpgroup kernel with the
# adapter fused lowers in test_an_adapter_on_the_products_own_rows_lowers_for_a_gpu_from_the_cpu; on every
# projection's tiles natively in test_grouped_matmul_gpu.py (test_a_fused_adapter_matches_on_the_tiles_of_each_...).
@pytest.mark.parametrize("key", [(2048, 1536, 128)])
def test_fused_adapter_kernels_lower_for_a_gpu_from_the_cpu(key):
    """The fused forward kernel through Mosaic GPU's CUDA lowering (layouts, shared memory) on the table's shapes
    with a rank-16 adapter, on `fused_config`'s tiles: one kernel. Through the custom VJP with an in-place layer
    stack: the forward (one kernel, or two while FUSED_LORA_ON_GPU is off) and the backward's three (d lhs, d xa,
    d b; the frozen stack's d rhs is dead code)."""
    from kernels_pallas.grouped_matmul import mosaic, tiles

    k, n, g = key
    S = jax.ShapeDtypeStruct
    args = (S((4096, k), jnp.bfloat16), S((2, g, k, n), jnp.bfloat16), S((g,), jnp.int32),
            S((4096, 16), jnp.bfloat16), S((g, 16, n), jnp.bfloat16))
    calls = lambda lowered: lowered.as_text().count("stablehlo.custom_call @mosaic_gpu")  # noqa: E731
    cfg = tiles.fused_config(tiles.config_for(*key), k, 16)
    kernel = lambda a, w, s, x, b: mosaic._rows(cfg)(a, w[1], s, cfg, lora=(x, b))  # noqa: E731
    assert calls(jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",))) == 1
    call = lambda a, w, s, x, b: mosaic.grouped_matmul_mosaic(  # noqa: E731
        a, w, s, row=1, lora=(x, b), interpret=False)
    forward = 1 if mosaic.FUSED_LORA_ON_GPU else 2
    assert calls(jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))) == forward
    loss = lambda a, w, s, x, b: call(a, w, s, x, b).astype(jnp.float32).sum()  # noqa: E731
    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 3, 4))).trace(*args).lower(lowering_platforms=("cuda",))
    assert calls(grads) == forward + 3


# The single-warpgroup entry (a warp-specialised kernel with an adapter fused lowers in
# test_fused_adapter_kernels_lower_for_a_gpu_from_the_cpu; both down projections' d lhs tiles natively in
# test_grouped_matmul_gpu.py::test_an_adapter_fused_into_the_d_lhs_kernel_matches_on_the_down_tiles).
@pytest.mark.parametrize("key", [(2880, 2880, 32)])
def test_an_adapter_on_the_products_own_rows_lowers_for_a_gpu_from_the_cpu(key):
    """`grouped_matmul_mosaic(adapter=)` on the down projections' shapes through Mosaic GPU's CUDA lowering, with a
    rank-16 adapter on an in-place layer stack: the d lhs kernel with the adapter fused (transposed rhs) alone, and
    the whole step: forward 2 kernels (xa = gmm(h, a); the experts' with (xa, b) fused), backward d xa, d lhs (with
    d xa @ a^T fused: one kernel, or two while FUSED_DLHS_LORA_ON_GPU is off), d b and d a."""
    from kernels_pallas.grouped_matmul import mosaic, tiles

    k, n, g = key
    S = jax.ShapeDtypeStruct
    args = (S((4096, k), jnp.bfloat16), S((2, g, k, n), jnp.bfloat16), S((g,), jnp.int32),
            S((g, k, 16), jnp.bfloat16), S((g, 16, n), jnp.bfloat16))
    calls = lambda lowered: lowered.as_text().count("stablehlo.custom_call @mosaic_gpu")  # noqa: E731
    cfg = tiles.fused_config(tiles._dlhs_config(tiles.config_for(*key), *key), n, 16)
    dlhs = lambda d, w, s, x, at: mosaic._rows(cfg)(d, w[1], s, cfg, transpose_rhs=True,  # noqa: E731
                                                    lora=(x, at))
    dargs = (S((4096, n), jnp.bfloat16), args[1], args[2], S((4096, 16), jnp.bfloat16), S((g, 16, k), jnp.bfloat16))
    assert calls(jax.jit(dlhs).trace(*dargs).lower(lowering_platforms=("cuda",))) == 1
    call = lambda h, w, s, a, b: mosaic.grouped_matmul_mosaic(h, w, s, row=1, adapter=(a, b),  # noqa: E731
                                                               interpret=False)
    assert calls(jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",))) == 2
    loss = lambda h, w, s, a, b: call(h, w, s, a, b).astype(jnp.float32).sum()  # noqa: E731
    grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 3, 4))).trace(*args).lower(lowering_platforms=("cuda",))
    assert calls(grads) == 2 + 4 + (0 if mosaic.FUSED_DLHS_LORA_ON_GPU else 1)
