"""`mesh: auto`: its candidates, and with `remat: auto` each mesh's own remat choice over made-up compiles. (Its
real compiles and the per-device estimate it chooses by, on host devices: test_sharding.)"""

from __future__ import annotations

import pytest

from jaxft.sharding import MeshConfig, MeshConfigError


def test_mesh_auto_candidates_go_from_data_to_fsdp():
    assert MeshConfig.from_mapping("auto").candidates(8) == [MeshConfig(data=8), MeshConfig(data=4, fsdp=2),
                                                             MeshConfig(data=2, fsdp=4), MeshConfig(data=1, fsdp=8)]
    assert MeshConfig.from_mapping("auto").shape(4) == {"data": 4, "fsdp": 1, "tensor": 1}  # until chosen
    assert MeshConfig(data=2).candidates(2) == [MeshConfig(data=2)]
    with pytest.raises(MeshConfigError, match="must be auto or a mapping"):
        MeshConfig.from_mapping("fsdp")


def test_mesh_auto_with_remat_auto_gives_each_mesh_its_remat_choice_and_says_when_nothing_fits():
    """`jaxft.memory.choice.choose_mesh` over a made-up compile callback (test_memory_choice's peaks by policy, 2 GiB
    more per device on the data-parallel mesh), 2 devices: with remat auto every policy is compiled on the
    data-parallel mesh, none fits, then fsdp's own remat choice (the first that fits) is the mesh's; with a budget
    nothing fits, one line names the smallest. (A Run's real compiles on 2 devices: the test above.)"""
    import dataclasses

    from jaxft.memory import GIB, Compiled, ExecutionConfigError, Trials
    from jaxft.memory.choice import choose_mesh
    from jaxft.memory.policy import AUTO_ORDER, LEAN_ATTN
    from test_memory_choice import PEAKS, _auto, _batch, _target

    target = dataclasses.replace(_target(), devices=(_target().devices[0],) * 2)
    dp, fsdp = MeshConfig(data=2), MeshConfig(data=1, fsdp=2)
    assert MeshConfig(auto=True).candidates(2) == [dp, fsdp]
    calls = []

    def compile(execution, depth=None, mesh=None):
        calls.append((execution.remat, mesh))
        gib = PEAKS[execution.remat] + (2.0 if mesh == dp else 0.0)
        return Compiled({"argument_size_in_bytes": 0, "temp_size_in_bytes": int(gib * GIB)}, 1.0)

    lines, trials = [], Trials()
    decision = choose_mesh(target, MeshConfig(auto=True), _auto(2.5), _batch(), compile, trials=trials,
                           log=lines.append)
    assert (decision.mesh, decision.execution.remat) == (fsdp, LEAN_ATTN)
    assert calls == [(p, dp) for p in AUTO_ORDER] + [("none", fsdp), ("offload+attn", fsdp), (LEAN_ATTN, fsdp)]
    assert lines[0] == ("mesh auto: device budget 2.500 GiB (max_memory_gb); candidates in order of communication: "
                        "{data: 2, fsdp: 1, tensor: 1}, {data: 1, fsdp: 2, tensor: 1}")
    assert "mesh auto: {data: 2, fsdp: 1, tensor: 1} no remat policy fits -> does not fit" in lines
    assert any(s.startswith("remat auto: none ") for s in lines)  # each mesh's own remat choice ran
    assert lines[-1] == "mesh auto: {data: 1, fsdp: 2, tensor: 1} estimated peak 2.000 GiB per device -> fits: chosen"
    lines.clear()
    with pytest.raises(ExecutionConfigError, match=r"^key 'max_memory_gb': no mesh fits in 0\.000 GiB per device "
                                                   r"\(max_memory_gb\): the smallest estimate is \{data: 1, fsdp: 2, "
                                                   r"tensor: 1\} at 1\.200 GiB"):
        choose_mesh(target, MeshConfig(auto=True), _auto(1e-4), _batch(), compile, trials=trials, log=lines.append)
    assert lines[-1] == "mesh auto: {data: 1, fsdp: 2, tensor: 1} no remat policy fits -> does not fit"
