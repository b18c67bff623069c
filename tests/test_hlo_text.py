"""tests/hlo_text.py (how the GPU tests read a scheduled HLO) on a synthetic program: `host_slice_forms` lists only
the dynamic (update) slices that read or write a pinned host buffer (memory space S(5)), each as a memcpy when XLA
gave it a dynamic slice config and as a kernel (a loop fusion) when not."""

from __future__ import annotations

from hlo_text import host_slice_counts, host_slice_forms

HLO = """
%fetch_kernel (param_0.1: bf16[4,64]) -> bf16[1,64] {
  %param_0.1 = bf16[4,64]{1,0:S(5)} parameter(0)
  %param_1.1 = s32[] parameter(1)
  ROOT %dynamic_slice.7.1 = bf16[1,64]{1,0} dynamic-slice(%param_0.1, %param_1.1, %c), dynamic_slice_sizes={1,64}
}

%fetch_copy (param_0.2: bf16[4,64]) -> bf16[1,64] {
  %param_0.2 = bf16[4,64]{1,0:S(5)} parameter(0)
  ROOT %dynamic_slice.8.1 = bf16[1,64]{1,0} dynamic-slice(%param_0.2, %i, %c), dynamic_slice_sizes={1,64}, backend_config={"dynamic_slice_config":{"byte_offset":"0","byte_stride":"128","loop_index":"0"}}
}

%stash (param_0.3: bf16[4,64], param_1.3: bf16[1,64]) -> bf16[4,64] {
  %param_0.3 = bf16[4,64]{1,0:S(5)} parameter(0)
  ROOT %dynamic-update-slice.2.1 = bf16[4,64]{1,0:S(5)} dynamic-update-slice(%param_0.3, %param_1.3, %i, %c)
}

%on_device (param_0.4: bf16[4,64]) -> bf16[1,64] {
  %param_0.4 = bf16[4,64]{1,0} parameter(0)
  ROOT %dynamic_slice.9.1 = bf16[1,64]{1,0} dynamic-slice(%param_0.4, %i, %c), dynamic_slice_sizes={1,64}
}
"""


def test_host_slices_are_told_apart_as_memcpys_and_kernels():
    assert host_slice_forms(HLO) == [("%dynamic_slice.7.1", "slice", False), ("%dynamic_slice.8.1", "slice", True),
                                     ("%dynamic-update-slice.2.1", "update", False)]
    assert host_slice_counts(HLO) == (1, 2)
