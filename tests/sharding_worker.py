"""Run by tests/test_sharding.py in one subprocess with 8 host CPU devices (JAX fixes its device count at start):
`python tests/sharding_worker.py WORKDIR OUT.json`, WORKDIR holding `model` and `train.jsonl` (the dense model),
`pallas` (`_per_device`'s model, head_dim 64), `qwen3_moe` and `gpt_oss` (`main_moe`'s), `full_model`,
`mesh_auto_model` and `mesh_auto.jsonl` (the 2-device scenarios'); OUT.json gets {"dense": main's results,
"per_device": _per_device's, "moe": main_moe's, "full": full's, "mesh_auto": mesh_auto's} (the 8-bit AdamW runs
leave their outputs under WORKDIR/adam8bit). One process for all of them: each process pays JAX's and jaxft's
start-up. Dense, what the test asserts on:

- losses: 3 fp32 LoRA steps on one device and on several meshes of the 8 devices (same global batches);
- all_gathers: every all-gather of the compiled FSDP step (layer scan) with its result shape and whether it
  runs inside a while loop (the layer scan's body or a computation it calls);
- loaded: for a model loaded sharded on {data: 2, fsdp: 2, tensor: 2}, per weight: its spec, the shapes of
  the device shards, whether every shard equals the matching slice of the unsharded weight; and the logits'
  largest difference from the unsharded model's.
- resumed: the losses of a `jaxft-train` run (`jaxft.train.train`) on {data: 2, fsdp: 4}, 5 steps with a
  checkpoint at step 3 (the settings of the loss runs above: its step is theirs, from the compilation cache), and
  of a run resumed from that checkpoint on {data: 8}, and the lines they logged about
  their batch-parallel devices;
- random: `Run.init_random` on {fsdp: 4, tensor: 2} against the same seed on one device: per array, its number
  of shards and whether every shard equals the matching slice of the one-device array; the init program's
  compiled bytes per device (outputs, temporaries) and the whole model's bytes.

On 2 of the devices (or a mesh with an fsdp axis of 2, where `jaxft-train`'s `train`, which spans every device,
runs):

- full: a full fine-tune on one device and under FSDP ({fsdp: 2} of 2 devices), the same batches: each run's
  per-step losses, the largest difference between the two runs' trained weights, and per trainable array of the
  FSDP run its PartitionSpec and those of its AdamW moments (mu, nu);
- adam8bit: `train` of examples/tiny-llama in full with 8-bit AdamW moments on {fsdp: 2} (data the rest), 3 steps
  with checkpoints at steps 2 and 3 (WORKDIR/adam8bit/whole), then a run resumed from the checkpoint of step 2
  (WORKDIR/adam8bit/resumed);
- mesh_auto: the per-device peak estimate of a tiny model's LoRA step on the data-parallel mesh and on the first
  fsdp one ({data: 4, fsdp: 2}) (XLA's memory analysis of the step compiled from shapes, the very programs
  `mesh: auto` compiles for its candidates, so that it finds them in the compilation cache;
  `jaxft.memory.budget.peak_estimate`), then `mesh: auto` training with a max_memory_gb between the two estimates
  (so pure data parallelism does not fit and fsdp does): the estimates, the lines `mesh: auto` logged, the steps run.
"""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import jax
import numpy as np
import optax

from jaxft.memory.execution import ExecutionConfig
from jaxft.io import from_pretrained
from jaxft.lora import LoraConfig
from jaxft.memory import peak_estimate
from jaxft.run import Run
from jaxft.sharding import MeshConfig, Placement
from jaxft.train import TrainConfig, read_metrics, train
from jaxft.train.optim import OptimConfig
from test_train_fixtures import logged_lines

REPO = Path(__file__).resolve().parents[1]
STEPS, ROWS, SEQ = 3, 16, 64


def _batches():
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(4, 64, (ROWS, SEQ)).astype(np.int32)
        seg = np.ones((ROWS, SEQ), np.int32)
        seg[:, SEQ // 2:] = 2
        pos = np.concatenate([np.arange(SEQ // 2), np.arange(SEQ // 2)])[None].repeat(ROWS, 0).astype(np.int32)
        mask = (rng.random((ROWS, SEQ)) < 0.8).astype(np.float32)
        out.append(dict(input_ids=ids, targets=np.roll(ids, -1, 1), loss_mask=mask, segment_ids=seg, positions=pos))
    return out


# MoE: the attention LoRA plus both expert adapters (PEFT's target_parameters).
MOE_LORA = LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj"),
                      target_parameters=("experts.gate_up_proj", "experts.down_proj"))


def _run(model_dir, mesh: dict | None, layer_loop: str, devices=None, lora: LoraConfig | None = None,
         moe_dispatch: str = "auto") -> Run:
    return Run(model_dir, lora_config=lora or LoraConfig(r=4, alpha=8), dtype="float32", total_steps=STEPS, seed=0,
               execution=ExecutionConfig(attention_implementation="reference", layer_loop=layer_loop,
                                         moe_dispatch=moe_dispatch),
               optim=OptimConfig(learning_rate=1e-2, lr_scheduler_type="constant"),
               mesh=MeshConfig.from_mapping(mesh), devices=devices, accumulation=2)


def _losses(run: Run, batches) -> list[float]:
    return [float(run.step(b, i)["loss"]) for i, b in enumerate(batches)]


def _all_gathers(hlo: str) -> list[dict]:
    """(shape, element type, inside a while loop) of every all-gather in the compiled HLO text."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) \(", line)
        if m:
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    called = {n: set(re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)",
                                "\n".join(body))) for n, body in comps.items()}
    in_loop: set[str] = set()
    todo = [b for body in comps.values() for line in body if " while(" in line
            for b in re.findall(r"body=%?([\w.\-]+)", line)]
    while todo:
        n = todo.pop()
        if n not in in_loop:
            in_loop.add(n)
            todo.extend(called.get(n, ()))
    out = []
    for n, body in comps.items():
        for line in body:
            m = re.search(r"= (\w+)\[([\d,]*)\]\S* all-gather(?:-start)?\(", line)
            if m:
                shape = [int(d) for d in m.group(2).split(",") if d]
                out.append(dict(shape=shape, type=m.group(1), in_loop=n in in_loop))
    return out


def _loaded(model_dir) -> dict:
    placement = Placement(MeshConfig(data=2, fsdp=2, tensor=2))
    sharded = from_pretrained(model_dir, "float32", mesh=placement)
    whole = from_pretrained(model_dir, "float32")
    ids = np.random.default_rng(1).integers(4, 64, (2, 48)).astype(np.int32)
    diff = float(np.max(np.abs(np.asarray(sharded(ids)) - np.asarray(whole(ids)))))
    from flax import nnx

    weights = {}
    want = dict(nnx.to_flat_state(nnx.state(whole)))
    for path, var in nnx.to_flat_state(nnx.state(sharded)):
        value, ref = var.get_value(), np.asarray(want[path].get_value())
        weights[".".join(map(str, path))] = dict(
            spec=[None if s is None else str(s) for s in value.sharding.spec],
            shard_shapes=sorted({tuple(s.data.shape) for s in value.addressable_shards}),
            shards_match=all(np.array_equal(np.asarray(s.data), ref[s.index]) for s in value.addressable_shards),
            num_shards=len(value.addressable_shards))
    return dict(logits_max_abs_diff=diff, weights=weights)


def _random(model_dir) -> dict:
    from flax import nnx

    one = _run(model_dir, None, "scan", devices=jax.devices()[:1]).init_random()
    mesh = _run(model_dir, dict(fsdp=4, tensor=2, data=1), "scan")
    memory = mesh.random_state_program()[1].lower().compile().memory_analysis()
    mesh.init_random()
    arrays, whole_bytes = {}, 0
    for part in ("lora", "frozen"):
        want = dict(nnx.to_flat_state(getattr(one, part)))
        for path, var in nnx.to_flat_state(getattr(mesh, part)):
            value, ref = var.get_value(), np.asarray(want[path].get_value())
            whole_bytes += ref.nbytes
            arrays[".".join(map(str, (part,) + path))] = dict(
                num_shards=len({str(s.index) for s in value.addressable_shards}),
                shards_match=all(np.array_equal(np.asarray(s.data), ref[s.index]) for s in value.addressable_shards))
    return dict(arrays=arrays, whole_bytes=whole_bytes, output_bytes=memory.output_size_in_bytes,
                temp_bytes=memory.temp_size_in_bytes)


def _resumed(workdir: Path) -> dict:
    """A jaxft-train run on {data: 2, fsdp: 4} and its checkpoint of step 3 resumed on {data: 8} (16 rows per step
    on both: 2 micro-batches of one row per device, `_run`'s settings, so that the first run's step is the loss
    runs' program); their logged losses and what they said about their batch-parallel devices."""
    out = {}
    for name, mesh, extra in (("fsdp", dict(data=2, fsdp=4), {}),
                              ("data", dict(data=8), dict(resume_from_checkpoint=str(workdir / "fsdp/checkpoints/3")))):
        cfg = dict(model_name_or_path=str(workdir / "model"), dataset=str(workdir / "train.jsonl"),
                   output_dir=str(workdir / name), max_seq_length=SEQ, per_device_train_batch_size=1,
                   gradient_accumulation_steps=2, max_steps=5, logging_steps=1, save_steps=3, learning_rate=1e-2,
                   lr_scheduler_type="constant", lora_r=4, lora_alpha=8, seed=0, bf16=False, disable_tqdm=True,
                   report_to="none", mesh=mesh, layer_loop="scan", remat="none", attention_implementation="reference",
                   **extra)
        with logged_lines("jaxft.train") as said:
            result = train(TrainConfig.from_dict(cfg))
        out[name] = dict(losses={r["step"]: r["loss"] for r in read_metrics(result.metrics_path) if "loss" in r},
                         devices=[line for line in said if "batch-parallel devices" in line])
    return out


def main(workdir: Path) -> dict:
    model_dir = workdir / "model"
    batches = _batches()
    result = {"losses": {"one_device": _losses(_run(model_dir, None, "scan", devices=jax.devices()[:1]).load(),
                                               batches)}}
    # data 8 (every weight whole on every device) is only loaded here: its training is `_resumed`'s second run
    for key, mesh, loop in (("data2_fsdp4", dict(data=2, fsdp=4), "scan"),
                            ("fsdp8_unrolled", dict(fsdp=8, data=1), "unroll"),
                            ("data8", dict(data=8), "scan")):
        run = _run(model_dir, mesh, loop)
        if key != "data8":
            compiled = run.compile(batches[0])  # before load: from shapes and shardings alone
            if key == "data2_fsdp4":
                result["all_gathers"] = _all_gathers(compiled.as_text())
            run.load()
            result["losses"][key] = _losses(run, batches)
            assert run._compiled is compiled, f"{key}: the step compiled before load was not reused"
        else:
            run.load()
        frozen_spec = run.frozen["layers"]["attn"]["q_proj"]["kernel"].get_value()
        frozen_spec = frozen_spec[0] if isinstance(frozen_spec, tuple) else frozen_spec
        result.setdefault("q_proj_spec", {})[key] = [None if s is None else str(s) for s in frozen_spec.sharding.spec]
        lora_a = run.lora["layers"]["attn"]["q_proj"]["lora_a"].get_value()
        result.setdefault("lora_replicated", {})[key] = bool(lora_a.sharding.is_fully_replicated)
    result["loaded"] = _loaded(model_dir)
    result["random"] = _random(model_dir)
    result["resumed"] = _resumed(workdir)
    return result


MOE_MESHES = {"data2_fsdp4": (dict(data=2, fsdp=4), "auto"), "fsdp4_tensor2": (dict(fsdp=4, tensor=2), "auto"),
              "data2_fsdp4_global": (dict(data=2, fsdp=4), "global")}


def _moe(model_dir: str, meshes: list[str]) -> dict:
    batches = _batches()
    one = _run(model_dir, None, "scan", devices=jax.devices()[:1], lora=MOE_LORA).load()
    result = {"losses": {"one_device": _losses(one, batches)}, "expert_spec": {}, "expert_lora_replicated": {},
              "sorted_slots": {}}
    for key in meshes:
        mesh, dispatch = MOE_MESHES[key]
        run = _run(model_dir, mesh, "scan", lora=MOE_LORA, moe_dispatch=dispatch).load()
        result["losses"][key] = _losses(run, batches)
        result["sorted_slots"][key] = sorted({int(n) for n in re.findall(  # the routing's stable sort: [slots] keys
            r"= \(s32\[(\d+)\]\{0\}, s32\[\d+\]\{0\}\) sort\(", run._compiled.as_text())})
        if dispatch == "global":
            continue
        mlp = run.frozen["layers"]["mlp"]
        stack = mlp["gate_up_proj"].get_value()
        result["expert_spec"][key] = [None if s is None else str(s) for s in stack.sharding.spec]
        lora_a = run.lora["layers"]["mlp"]["down_lora"]["lora_a"].get_value()
        result["expert_lora_replicated"][key] = bool(lora_a.sharding.is_fully_replicated)
    return result


def main_moe(qwen_dir: Path, gpt_oss_dir: Path) -> dict:
    """Each MoE model's losses on one device and on meshes that split its expert stacks (expert adapters included;
    the grouped matmuls are lax.ragged_dot here), each device routing its own rows (moe_dispatch auto =
    per_device) on fsdp 4 x tensor 2, and Qwen3-MoE's with the routing global on data 2 x fsdp 4; the slots each
    device's compiled step sorts; where its frozen expert stacks and its expert adapters were placed."""
    return {"qwen3_moe": _moe(qwen_dir, ["fsdp4_tensor2", "data2_fsdp4_global"]),
            "gpt_oss": _moe(gpt_oss_dir, ["fsdp4_tensor2"])}


def _per_device(model_dir: str) -> dict:
    """One device against data=2 x fsdp=2, 3 steps' losses of QLoRA (nf4, double-quantised, the default "xla" 4-bit
    matmul) with Pallas flash attention (interpreted here), and the shapes of every all-gather in the mesh's
    compiled step whose result leads with the whole batch's rows (activations gathered to every device: each
    device would then compute every row; `jaxft.models.decoder.per_device_attention` must keep Pallas attention
    from gathering), plus each 4-bit array's partition spec (by its name: packed, absmax, ...) and the element
    types of the all-gathers inside the layer scan."""
    from flax import nnx

    from jaxft.models.layers import QuantizedWeight
    from jaxft.quant import QuantConfig

    batches = _batches()[:3]
    result = {"losses": {}}
    for key, mesh in (("one_device", None), ("data2_fsdp2", dict(data=2, fsdp=2))):
        run = Run(model_dir, lora_config=LoraConfig(r=4, alpha=8), dtype="float32", total_steps=STEPS, seed=0,
                  execution=ExecutionConfig(attention_implementation="pallas", layer_loop="scan"),
                  optim=OptimConfig(learning_rate=1e-2, lr_scheduler_type="constant"),
                  quant_config=QuantConfig(),
                  mesh=MeshConfig.from_mapping(mesh), devices=jax.devices()[:1] if mesh is None else jax.devices()[:4])
        hlo = run.compile(batches[0]).as_text()
        run.load()
        if mesh is not None:
            gathers = re.findall(rf"= (\w+\[{ROWS}(?:,\d+)+\])\S* all-gather", hlo)
            result["row_gathers"] = sorted(set(gathers))
            specs = {}
            for path, v in nnx.to_flat_state(run.frozen):
                if isinstance(v, QuantizedWeight):
                    spec = [None if a is None else str(a) for a in v.get_value().sharding.spec]
                    specs.setdefault(str(path[-1]), []).append(spec)
            result["quant_specs"] = specs
            result["loop_gather_types"] = sorted({g["type"] for g in _all_gathers(hlo) if g["in_loop"]})
        result["losses"][key] = _losses(run, batches)
    return result


# ------------------------------------------------------------------------------------------------ full fine-tune

FULL_STEPS, FULL_ROWS, FULL_SEQ = 2, 4, 32


def _full_batch(step: int) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(step).integers(0, 64, (FULL_ROWS, FULL_SEQ + 1)).astype(np.int32)
    ones = np.ones((FULL_ROWS, FULL_SEQ), np.int32)
    return dict(input_ids=ids[:, :-1], targets=ids[:, 1:], loss_mask=ones, segment_ids=ones.copy(),
                positions=np.broadcast_to(np.arange(FULL_SEQ, dtype=np.int32), (FULL_ROWS, FULL_SEQ)).copy())


def _full_run(model_dir: Path, mesh: MeshConfig, devices) -> Run:
    return Run(model_dir, LoraConfig(), dtype="float32", total_steps=FULL_STEPS, finetuning_type="full", mesh=mesh,
               devices=devices, execution=ExecutionConfig(attention_implementation="reference"),
               optim=OptimConfig(learning_rate=1e-2, lr_scheduler_type="constant", weight_decay=0.1)).load()


def _spec(x) -> str:
    return str(x.sharding.spec)


def full(model_dir: Path) -> dict:
    runs = {"one": _full_run(model_dir, MeshConfig(), jax.devices()[:1]),
            "fsdp": _full_run(model_dir, MeshConfig(fsdp=2), jax.devices()[:2])}
    losses = {name: [float(run.step(_full_batch(s), s)["loss"]) for s in range(FULL_STEPS)]
              for name, run in runs.items()}
    one, fsdp = (jax.tree.leaves(runs[n].lora) for n in ("one", "fsdp"))
    weights = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(one, fsdp))
    adam = [s for s in jax.tree.leaves(runs["fsdp"].opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)][0]
    specs = {jax.tree_util.keystr(path): [_spec(w), _spec(m), _spec(v), list(w.shape)]
             for (path, w), m, v in zip(jax.tree_util.tree_flatten_with_path(runs["fsdp"].lora)[0],
                                        jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu))}
    return {"losses": losses, "weights": weights, "specs": specs}


# ------------------------------------------------------------------------------------------------ 8-bit AdamW


def adam8bit(out: Path) -> None:  # on {data: 4, fsdp: 2}: `train` spans every device
    def run(name: str, **over):
        values = dict(model_name_or_path=str(REPO / "examples/tiny-llama"),
                      dataset=str(REPO / "examples/data/train.jsonl"), output_dir=str(out / name),
                      finetuning_type="full", optim="adamw_8bit", mesh={"fsdp": 2}, max_seq_length=64,
                      per_device_train_batch_size=2, max_steps=3, save_steps=2, logging_steps=1, learning_rate=1e-3,
                      lr_scheduler_type="constant", bf16=False, disable_tqdm=True, report_to="none", seed=0)
        train(TrainConfig.from_dict({**values, **over}))

    run("whole")  # checkpoints at steps 2 and 3
    run("resumed", resume_from_checkpoint=str(out / "whole" / "checkpoints" / "2"))


# ------------------------------------------------------------------------------------------------ mesh: auto

# `mesh: auto`'s first two candidates on 8 devices: every device on data, then fsdp 2
AUTO_MESHES = {"dp": {"data": 8, "fsdp": 1}, "fsdp": {"data": 4, "fsdp": 2}}
AUTO_STEPS, AUTO_SEQ_LEN, AUTO_ROWS_PER_DEVICE = 2, 64, 2


def _auto_config(model: Path, data: Path, out: Path, mesh, max_memory_gb: float | None = None) -> TrainConfig:
    return TrainConfig(model_name_or_path=str(model), dataset=str(data), output_dir=str(out),
                       max_seq_length=AUTO_SEQ_LEN, per_device_train_batch_size=AUTO_ROWS_PER_DEVICE,
                       max_steps=AUTO_STEPS, logging_steps=1, lora_r=4, bf16=False,
                       attention_implementation="reference", remat="none", layer_loop="scan", mesh=mesh,
                       max_memory_gb=max_memory_gb, disable_tqdm=True, report_to="none", seed=0)


def _estimate(config: TrainConfig) -> dict:
    """The compiled memory analysis (bytes per device) of the LoRA step that `config`'s run (its mesh given)
    compiles from shapes, as `mesh: auto` compiles each candidate, and its "peak" as `mesh: auto` reckons it; no
    weight is read."""
    run = Run.from_config(config, AUTO_STEPS)
    rows = AUTO_ROWS_PER_DEVICE * run.placement.batch_parallel
    batch = {k: np.zeros((rows, AUTO_SEQ_LEN), np.float32 if k == "loss_mask" else np.int32)
             for k in ("input_ids", "targets", "loss_mask", "segment_ids", "positions")}
    run.compile(batch)
    analysis = run.memory_analysis()
    return dict(analysis, peak=peak_estimate(analysis))


def mesh_auto(model: Path, data: Path, out: Path) -> dict:
    estimates = {kind: _estimate(_auto_config(model, data, out, mesh)) for kind, mesh in AUTO_MESHES.items()}
    budget = (estimates["dp"]["peak"] + estimates["fsdp"]["peak"]) / 2 / 2**30
    with logged_lines("jaxft") as lines:
        res = train(_auto_config(model, data, out, "auto", budget))
    return {"estimates": estimates, "budget_gib": budget,
            "mesh_lines": [s for s in lines if s.startswith("mesh auto")], "steps": res.global_step}


if __name__ == "__main__":
    gc.freeze()  # the import heap: full collections (the run's own among them) then skip it, as in conftest
    assert len(jax.devices()) == 8, jax.devices()
    root = Path(sys.argv[1])
    results = {"dense": main(root), "per_device": _per_device(root / "pallas"),
               "moe": main_moe(root / "qwen3_moe", root / "gpt_oss"), "full": full(root / "full_model"),
               "mesh_auto": mesh_auto(root / "mesh_auto_model", root / "mesh_auto.jsonl", root / "mesh_auto_out")}
    adam8bit(root / "adam8bit")
    with open(sys.argv[2], "w") as f:
        json.dump(results, f, indent=1)
