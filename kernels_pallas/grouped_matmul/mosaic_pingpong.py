"""The ping-pong row-tile kernel (``TileConfig.wg_split == "unit"``): a memory warpgroup feeds two compute
warpgroups that take an SM's (row tile, N-block) units in turn, each multiplying and storing whole units.

Why: in `gmm_rows_ws` both compute warpgroups work on one unit and finish it together, so the tensor cores wait while
they convert and store the output tile. Here compute warpgroup 0 takes the SM's units 0, 2, 4, ... and warpgroup 1
the units 1, 3, 5, ...; while one stores its unit, the other multiplies the next one. A unit is block_m x block_n,
one warpgroup's accumulator, so the tile is at most 128 x 192 (192 registers a thread, within the 232 a compute
warpgroup gets beside the memory warpgroup's 40).

The pipeline is written here, not JAX's ``emit_pipeline_warp_specialized``, whose compute warpgroups all consume every
stage. One ring of ``stages`` slots (an lhs tile and an rhs tile each) serves the SM's contraction steps in order:
step t (of unit j, step kk: t = j k_steps + kk) goes to slot t mod stages. The memory warpgroup loads step t once slot
t - stages is free (``free`` barrier, arrived at by whichever warpgroup consumed it) and signals the loads on
``full[j mod 2, slot]``: a barrier per compute warpgroup and slot. Why two sets: a warpgroup tracks a barrier's phase
by counting its own waits, and it waits only on its own units' steps; on a shared barrier the other warpgroup's uses
would flip the phase under it (an odd count per unit breaks the parity). With its own barriers a warpgroup's count is
exact, and the barrier is never two phases ahead of it: its next use of a slot loads only after it freed the slot's
last one. The two warpgroups' products need no ordering between them: the ring hands out the steps in order, so a
warpgroup's first steps load as the other's last ones free their slots, and the tensor cores take the wgmmas of both.

Same schedule (``row_tiles``), operands (``_row_operands``: ``rhs_base``, padding), stores (``_store_rows_from``)
and fused adapter (``lora``: each compute warpgroup loads its unit's xa / b tiles before its products and adds their
product after) as the other row kernels; see `mosaic_kernels`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .mosaic_kernels import (_ROW_ALIGN, _kernel, _lora_load, _lora_scratch, _lora_step, _real_tiles, _row_operands,
                             _store_rows_from, _swizzled, _unit)
from .tiles import TileConfig

_MEMORY_REGISTERS = 40  # the memory warpgroup issues TMA copies only
_COMPUTE_REGISTERS = 232  # (512 - 40) / 2 rounded down to a multiple of 8: what setmaxnreg allows each compute WG


def gmm_rows_pp(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, cfg: TileConfig, *,
                transpose_rhs: bool = False, interpret: bool = False, rhs_base=None, lora=None) -> jax.Array:
    """``gmm_rows`` (same arguments, same results) with the two compute warpgroups taking alternate units
    (module docstring)."""
    m = lhs.shape[0]
    g = group_sizes.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm, bn, bk, stages = cfg.block_m, cfg.block_n, cfg.block_k, cfg.stages
    lhs_p, rhs_p, rhs_index, tiles, lora, mp, np_, grid_n, k_steps = _row_operands(
        lhs, rhs, group_sizes, bm, bk, bn, transpose_rhs, rhs_base, lora)
    dtype = lhs.dtype
    b_block = (bn, bk) if transpose_rhs else (bk, bn)

    def rhs_step(rhs_ref, matrix, ni, kk):
        cols, steps = pl.ds(ni * bn, bn), pl.ds(kk * bk, bk)
        return rhs_ref.at[matrix, cols, steps] if transpose_rhs else rhs_ref.at[matrix, steps, cols]

    def body(group_ref, index_ref, row0_ref, lo_ref, hi_ref, count_ref, lhs_ref, rhs_ref, *refs):
        *lora_refs, out_ref = refs
        scratch = dict(
            a_smem=plgpu.SMEM((stages, bm, bk), dtype, transforms=_swizzled(bk, dtype)),
            b_smem=plgpu.SMEM((stages, *b_block), dtype, transforms=_swizzled(bk if transpose_rhs else bn, dtype)),
            full=plgpu.Barrier(num_arrivals=2, num_barriers=2 * stages),  # [compute warpgroup, slot]: lhs + rhs
            free=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            o_smem=plgpu.SMEM((2, bm, bn), dtype))
        if lora is not None:
            scratch |= zip(("xa_smem", "lb_smem", "lora_barrier"),
                           _lora_scratch(bm, lora[0].shape[1], bn, dtype, copies=2))
        count = count_ref[0]
        units = lambda: plgpu.nd_loop((count * grid_n,), collective_axes="sm")

        @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
        def _(a_smem, b_smem, full, free, o_smem, **lora_smem):
            wg = jax.lax.axis_index("wg")

            @pl.when(wg == 2)
            def _memory():
                plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

                @units()
                def _(info: plgpu.NDLoopInfo):
                    ti, ni = _unit(info.index[0], count, grid_n, cfg)
                    j = info.local_index
                    rows = lhs_ref.at[pl.ds(pl.multiple_of(row0_ref[ti], _ROW_ALIGN), bm)]
                    matrix = index_ref[ti]

                    @pl.loop(0, k_steps)
                    def _(kk):
                        t = j * k_steps + kk
                        slot = t % stages
                        pl.when(t >= stages)(lambda: plgpu.barrier_wait(free.at[slot]))
                        loaded = full.at[(j % 2) * stages + slot]
                        plgpu.copy_gmem_to_smem(rows.at[:, pl.ds(kk * bk, bk)], a_smem.at[slot], loaded)
                        plgpu.copy_gmem_to_smem(rhs_step(rhs_ref, matrix, ni, kk), b_smem.at[slot], loaded)

                    # After the SM's last loads, wait for the ring's last uses to be freed: a barrier must not go out
                    # of scope with phases its waiter has not seen.
                    @pl.when(j == info.num_local_steps - 1)
                    def _():
                        end = (j + 1) * k_steps

                        @pl.loop(jnp.maximum(end - stages, 0), end)
                        def _(t):
                            plgpu.barrier_wait(free.at[t % stages])

            @pl.when(wg < 2)
            def _compute():
                plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")

                @units()
                def _(info: plgpu.NDLoopInfo):
                    j = info.local_index

                    @pl.when(j % 2 == wg)
                    def _():
                        ti, ni = _unit(info.index[0], count, grid_n, cfg)
                        group, row0, lo, hi = group_ref[ti], row0_ref[ti], lo_ref[ti], hi_ref[ti]
                        col0 = ni * bn
                        # The pseudo-group's rows and a tile that stores nothing multiply nothing (acc stays 0).
                        multiply = (group < g) & (hi > lo)
                        mine = [lora_smem[k].at[wg] for k in ("xa_smem", "lb_smem", "lora_barrier")] \
                            if lora_smem else None

                        def products(acc_ref):
                            if mine:
                                _lora_load(*lora_refs, *mine, row0, jnp.minimum(group, g - 1), col0, bm, bn)

                            @pl.loop(0, k_steps)
                            def _(kk):
                                slot = (j * k_steps + kk) % stages
                                plgpu.barrier_wait(full.at[wg * stages + slot])
                                b = b_smem.at[slot]
                                b = b.transpose((1, 0)) if transpose_rhs else b
                                pl.when(multiply)(lambda: plgpu.wgmma(acc_ref, a_smem.at[slot], b))
                                plgpu.wgmma_wait(0)  # the slot is read: the memory warpgroup may refill it
                                plgpu.barrier_arrive(free.at[slot])

                            if mine:
                                _lora_step(acc_ref, *mine, multiply)
                            return acc_ref[...]

                        acc = pl.run_scoped(products, plgpu.ACC((bm, bn), jnp.float32)).astype(dtype)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this warpgroup's last stores left o_smem
                        o_smem[wg] = acc
                        plgpu.commit_smem()
                        _store_rows_from(o_smem.at[wg], out_ref, row0, lo - row0, hi - lo, col0, bm, bn)

                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    group = tiles[0]
    out = _kernel(body, jax.ShapeDtypeStruct((mp, np_), dtype), interpret, "gmm_rows_pp", num_threads=3,
                  thread_name="wg")(group, rhs_index(group), *tiles[1:], _real_tiles(group, g), lhs_p, rhs_p,
                                    *(lora or ()))
    return out[:m, :n]
