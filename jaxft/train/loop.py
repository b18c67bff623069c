"""`train(config) -> TrainResult`: the whole LoRA fine-tuning run behind `jaxft-train`.

Order of work (nothing is written to `output_dir` until every input has been validated):
  1. validate: config, checkpoint to resume from, data (read, tokenize, pack), model (load, apply LoRA);
  2. take output_dir's writer lock (a second run on the same directory is refused), restore the checkpoint
     (LoRA, optimizer state, step, RNG, token count) when resuming;
  3. compile the step ahead of time (its time is reported on its own line), then steps: batch
     `PackedDataset.batch(step)` (a pure function of the step, so a resumed run sees the same batches), one
     jitted update; metrics per logging window, timed from device sync to device sync (`meter.WindowMeter`);
     eval every `eval_steps`, checkpoint every `save_steps` and at the end; SIGINT/SIGTERM end the run after
     the current step with a checkpoint (`TrainingInterrupted`);
  4. export: loss-curve PNG, PEFT adapter (output_dir/adapter) or, for `finetuning_type: full`, the trained model
     (output_dir/model, an HF checkpoint), optionally the merged model (output_dir/merged),
     each written beside its place and swapped in by renames (`_swap_dir`; a killed swap is undone at the next
     start).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

# The module, not its names: jaxft.run imports this package's step and optim modules, so while jaxft.run loads
# first, this package (and this module, which it re-exports) loads inside it and finds jaxft.run half made.
import jaxft.run
from bridge import read_config
from jaxft import distributed
from jaxft.config import ModelConfig
from jaxft.data.formatting import load_tokenizer
from jaxft.data.images import ImageProcessor
from jaxft.data.pipeline import build_datasets
from jaxft.data.preference import build_preference_datasets
from jaxft.generation import generate
from jaxft.lora import LoraConfigError, new_token_config
from jaxft.memory import ExecutionConfigError, claim_gpu_memory
from jaxft.sharding import MeshConfigError
from jaxft.train import checkpoint as ckpt
from jaxft.train.config import TrainConfig
from jaxft.train.guard import OutputDirLock, StopRequests, TrainingDiverged, TrainingInterrupted
from jaxft.train.meter import RunSummary, WindowMeter, device_peak_bytes
from jaxft.train.metrics import MetricsWriter, plot_loss_curve, read_metrics
from jaxft.train.keys import TrainConfigError, part_error
from jaxft.train.sections import LoggingSection

logger = logging.getLogger("jaxft.train")


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a run produced. `train_loss` is the mean loss of the last logging window (what the progress bar and
    metrics.jsonl show last); `eval_loss` the last evaluation (or None); `summary` the run's speed and cost."""

    output_dir: Path
    adapter_dir: Path | None  # None for a full fine-tune, whose trained model is `model_dir`
    merged_dir: Path | None
    metrics_path: Path
    loss_curve: Path | None
    checkpoint_dir: Path
    global_step: int
    train_loss: float | None
    eval_loss: float | None
    resumed_from: str | None
    summary: RunSummary | None = None
    gguf_file: Path | None = None
    model_dir: Path | None = None  # finetuning_type full: the trained model, an HF checkpoint


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Step arithmetic of a run."""

    rows_per_step: int
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int


def _plan(config: TrainConfig, num_rows: int, num_devices: int) -> _Plan:
    rows = config.rows_per_step(num_devices)
    per_epoch = math.ceil(num_rows / rows)
    optim = config.optim
    total = optim.max_steps if optim.max_steps > 0 else max(1, math.ceil(optim.num_train_epochs * per_epoch))
    return _Plan(rows, per_epoch, total, config.optim_config.warmup_for(total))


# ---------------------------------------------------------------------------------------------- setup pieces
def _resume_path(config: TrainConfig, out: Path) -> str | None:
    resume = config.logging.resume_from_checkpoint
    if resume is None or resume is False:
        return None
    path = out / "checkpoints" if resume is True else Path(resume)
    if resume is True and not path.is_dir():
        raise TrainConfigError(
            f"key 'resume_from_checkpoint': no complete checkpoint in {path} (output_dir has no checkpoints yet); "
            "drop resume_from_checkpoint / --resume to start from scratch, or fix output_dir")
    try:
        root, step = ckpt.resolve(path)
    except ckpt.CheckpointError as e:
        raise TrainConfigError(f"key 'resume_from_checkpoint': {e}") from None
    # A checkpoints root (or output_dir) lets the restore fall back past a damaged newest step; one step's
    # directory names that step only.
    return str(root / str(step)) if Path(path).expanduser().absolute() == root / str(step) else str(root)


def _probe_writable(existing: Path) -> None:
    """One line when `existing` takes no file: a probe file, not os.access, which says yes to root on a read-only
    mount."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".jaxft-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise TrainConfigError(f"key 'output_dir': cannot write to {existing} ({e.strerror}); choose a writable "
                               "output_dir", key="output_dir") from None


def _check_output_dir(config: TrainConfig, out: Path, resuming: bool) -> None:
    if out.exists() and not out.is_dir():
        raise TrainConfigError(f"key 'output_dir': {str(out)!r} exists and is not a directory; choose another path")
    existing = next(p for p in (out, *out.parents) if p.exists())
    if distributed.is_main_process():  # the others write only inside checkpoints/, which orbax checks itself
        _probe_writable(existing)
    ck = out / "checkpoints"
    has_ckpt = ck.is_dir() and any(c.name.isdigit() for c in ck.iterdir())
    if has_ckpt and not resuming and not config.logging.overwrite_output_dir:
        raise TrainConfigError(
            f"key 'output_dir': {str(out)!r} already holds checkpoints of a run; pass resume_from_checkpoint=true "
            "to continue it, overwrite_output_dir=true to start over, or choose a new output_dir")


def _new_tokens(config: TrainConfig, tokenizer) -> dict[str, Any]:
    """Run.from_config's overrides for `add_special_tokens`: the vocabulary grown to the tokenizer's (where it
    outgrew the model's) and those tokens' rows trained (`jaxft.lora.new_token_config`)."""
    if not config.model.add_special_tokens:
        return {}
    model = ModelConfig.from_hf(read_config(config.model.model_name_or_path))
    ids = tokenizer.convert_tokens_to_ids(list(config.model.add_special_tokens))
    try:
        lora_config = new_token_config(config.lora_config, ids, model.tie_word_embeddings)
    except LoraConfigError as e:
        raise TrainConfigError(f"key 'add_special_tokens': {e}", key="add_special_tokens") from None
    return dict(lora_config=lora_config, vocab_size=max(model.vocab_size, len(tokenizer)))


def _load_data(config: TrainConfig, num_devices: int):
    tokenizer = load_tokenizer(config.model.model_name_or_path)
    if config.model.add_special_tokens:  # before the data is tokenized: the new tokens get their own ids
        tokenizer.add_tokens(list(config.model.add_special_tokens), special_tokens=True)
    images = ImageProcessor.for_model_dir(config.model.model_name_or_path,  # None for a text-only model
                                          confine=not config.data.image_paths_outside_dataset)
    if config.objective_config is not None:  # DPO: preference pairs, a row holding whole pairs
        train_ds, eval_ds = build_preference_datasets(config.data_config(num_devices), tokenizer)
    else:
        train_ds, eval_ds = build_datasets(config.data_config(num_devices), tokenizer, images)
    return tokenizer, train_ds, eval_ds


EXPORTS = ("adapter", "merged", "model")


def _swap_dir(new: Path, target: Path) -> None:
    """Puts the finished `new` at `target` by renames only: the old `target` becomes `.<name>.old`, `new` takes
    its place, then the old one is removed. A kill at any point leaves a complete `target` or `.<name>.old`,
    which `recover_exports` puts back."""
    backup = target.with_name(f".{target.name}.old")
    if backup.exists():
        shutil.rmtree(backup)
    if target.exists():
        target.rename(backup)
    new.rename(target)
    shutil.rmtree(backup, ignore_errors=True)


def recover_exports(out: Path) -> None:
    """Undoes what a run killed while exporting left in `out`: a missing adapter/merged directory comes back from
    its `.old` copy; partly written `.new` / `.tmp-*` directories are removed."""
    for name in EXPORTS:
        target, backup = out / name, out / f".{name}.old"
        if backup.is_dir():
            if target.exists():
                shutil.rmtree(backup)
            else:
                backup.rename(target)
                logger.warning("restored %s from %s (a run was killed while replacing it)", target, backup.name)
        # `.<name>.new` and what the writers leave beside a target when killed (`.<target>.tmp-*` / `.old-*`)
        for leftover in [*out.glob(f".{name}.*"), *out.glob(f"..{name}.*")]:
            shutil.rmtree(leftover, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class _Setup:
    """Everything `train` validated and built before output_dir is touched."""

    plan: _Plan
    tokenizer: Any
    train_ds: Any
    eval_ds: Any
    run: Any  # jaxft.run.Run
    start_step: int
    start_tokens: int
    resume_path: str | None
    identity: dict[str, Any]


def train(config: TrainConfig) -> TrainResult:
    """Fine-tunes LoRA adapters as `config` says; see the module docstring. Raises `TrainConfigError` or a
    `jaxft.data.errors.DataError` (both ValueErrors with one-line messages) on bad input, before writing anything;
    `TrainingInterrupted` after writing a checkpoint when SIGINT/SIGTERM stopped the run."""
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train() takes a TrainConfig, got {type(config).__name__}")
    wall_start = time.perf_counter()
    claim_gpu_memory()  # both before anything touches a device
    distributed.initialize(config.distributed_config)
    main = distributed.is_main_process()
    out = Path(config.logging.output_dir).expanduser().absolute()
    lock = OutputDirLock(out)
    if main:  # process 0 holds the lock for the run's processes (the others write no file of their own)
        lock.check()  # refuse early, before minutes of loading, when another live run writes there
    setup = _prepare(config, out)
    # ---- everything validated: from here on output_dir is written (by this run only)
    if main:
        lock.acquire()
    try:
        return _run(config, out, setup, wall_start)
    except Exception as e:
        if _disk_full(e):
            raise TrainConfigError(
                f"key 'output_dir': the disk of {out} is full (no space left on device); free space or choose "
                "another output_dir, then resume: complete checkpoints and the previous adapter are kept",
                key="output_dir") from None
        raise
    finally:
        if main:
            lock.release()


def _disk_full(e: BaseException) -> bool:
    """Whether `e` says a write ran out of disk: OSError ENOSPC / EDQUOT, or tensorstore's error for it inside
    orbax (RESOURCE_EXHAUSTED with the OS error's text; a device out of memory says neither)."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "No space left on device" in text or "Disk quota exceeded" in text


def _prepare(config: TrainConfig, out: Path) -> _Setup:
    resume_path = _resume_path(config, out)
    _check_output_dir(config, out, resume_path is not None)

    try:  # on the shapes only: a target that matches nothing is reported before the data is read
        placement = jaxft.run.check_config(config)
    except LoraConfigError as e:
        raise part_error(e, "lora") from None
    except MeshConfigError as e:  # the mesh does not fit this process's devices
        raise TrainConfigError(str(e), key="mesh") from None
    except ExecutionConfigError as e:  # settings that do not fit these devices (frozen_weights: host on several)
        raise part_error(e, "memory") from None
    num_devices = placement.batch_parallel  # the devices batch rows are split over (all processes')
    if jax.process_count() > 1 and config.logging.eval_generate_prompts:
        raise TrainConfigError("key 'eval_generate_prompts': sample generation runs in one process only; drop it "
                               f"for this {jax.process_count()}-process run", key="eval_generate_prompts")

    tokenizer, train_ds, eval_ds = _load_data(config, num_devices)
    plan = _plan(config, train_ds.num_rows, num_devices)
    assert plan.steps_per_epoch == train_ds.num_batches_per_epoch, (plan, train_ds.num_batches_per_epoch)
    logger.info("%d rows per step (%d rows x %d micro-batches x %d batch-parallel devices), %d steps per epoch, "
                "%d steps",
                plan.rows_per_step, config.data.per_device_train_batch_size,
                config.optim.gradient_accumulation_steps, num_devices, plan.steps_per_epoch, plan.total_steps)
    if config.optim.lr_scheduler_type == "constant" and plan.warmup_steps:
        logger.warning("lr_scheduler_type=constant ignores warmup (as in transformers); use constant_with_warmup "
                       "for %d warmup steps", plan.warmup_steps)
    run = jaxft.run.Run.from_config(config, plan.total_steps, **_new_tokens(config, tokenizer))
    if config.execution_config.remat == "auto" or run.mesh.auto:  # compiled from shapes, before any weight is placed
        try:
            if run.mesh.auto:  # (with remat auto, each mesh gets its own remat choice)
                run.choose_mesh(_local_batch(run, train_ds, 0))
            else:
                run.choose_remat(_local_batch(run, train_ds, 0))
        except ExecutionConfigError as e:
            raise part_error(e, "memory") from None
    rows = plan.rows_per_step // config.optim.gradient_accumulation_steps
    for level, line in run.describe(rows, config.model.max_seq_length,
                                    samples=bool(config.logging.eval_generate_prompts)):
        logger.log(level, line)
    run.load()
    try:  # the step's temp must fit beside the pool the load left (a growing allocator's regions)
        run.fit_allocator(_local_batch(run, train_ds, 0))
    except ExecutionConfigError as e:
        raise part_error(e, "memory") from None
    start_step, start_tokens = 0, 0
    identity = _run_identity(config, run, train_ds)
    if resume_path is not None:
        try:
            restored = ckpt.restore(resume_path, run.lora, run.opt_state,
                                    check_meta=lambda meta: _check_identity(meta, identity))
        except ckpt.CheckpointError as e:
            raise TrainConfigError(f"key 'resume_from_checkpoint': {e}") from None
        meta, resume_path = restored.meta, str(restored.path)
        run.set_state(restored.lora, restored.opt_state)
        start_step, run.rng = int(meta["step"]), ckpt.rng_from_json(meta["rng"])
        _check_resume_meta(meta, config, plan, train_ds.num_rows)
        # Checkpoints written before the count was kept: recount (batches are a pure function of the step).
        start_tokens = int(meta["num_tokens"]) if "num_tokens" in meta else sum(
            train_ds.num_tokens(s) for s in range(start_step))
        logger.info("resumed from %s at step %d (epoch %d, step %d of the epoch)", resume_path, start_step,
                    meta["epoch"], meta["step_in_epoch"])
    return _Setup(plan=plan, tokenizer=tokenizer, train_ds=train_ds, eval_ds=eval_ds, run=run,
                  start_step=start_step, start_tokens=start_tokens, resume_path=resume_path, identity=identity)


def _run(config: TrainConfig, out: Path, setup: _Setup, wall_start: float) -> TrainResult:
    """Steps, evaluation, checkpoints and exports; the caller holds the output_dir lock."""
    plan, train_ds, eval_ds, run = setup.plan, setup.train_ds, setup.eval_ds, setup.run
    start_step, resume_path, tokenizer = setup.start_step, setup.resume_path, setup.tokenizer
    main = distributed.is_main_process()
    if main:
        recover_exports(out)
        if resume_path is not None:  # later checkpoints belong to another timeline (or were found damaged)
            ckpt.discard_after(out / "checkpoints", start_step, out)
        if resume_path is None and config.logging.overwrite_output_dir and (out / "checkpoints").exists():
            shutil.rmtree(out / "checkpoints")
        (out / "train_config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")
    distributed.sync("jaxft:output_dir")  # old checkpoints are gone before any process makes the manager
    log = config.logging
    checkpointer = ckpt.Checkpointer(out / "checkpoints", save_steps=log.save_steps, max_to_keep=log.save_total_limit)
    writer = (MetricsWriter(out, resume_step=start_step if resume_path else None,
                            tensorboard=log.report_to == "tensorboard") if main else _NoMetrics(out))
    num_tokens = setup.start_tokens  # cumulative non-padding tokens trained on (TRL's num_tokens)
    trained = "weights" if run.full else "LoRA"  # what a non-finite value's path starts with
    export = "model" if run.full else "adapter"  # the run's export directory in output_dir

    def meta_for(step: int) -> dict[str, Any]:
        epoch, in_epoch = divmod(step, plan.steps_per_epoch)
        return dict(step=step, epoch=epoch, step_in_epoch=in_epoch, rng=ckpt.rng_to_json(run.rng),
                    seed=config.optim.seed, rows_per_step=plan.rows_per_step,
                    max_seq_length=config.model.max_seq_length, num_rows=train_ds.num_rows,
                    total_steps=plan.total_steps, num_tokens=num_tokens, identity=setup.identity)

    def evaluate(step: int) -> float:
        means: dict[str, float] = {}  # the objective's own (DPO: rewards/*, logps/*)
        loss_sum, count = run.evaluate(_local_batches(run, eval_ds), metrics=means)
        value = loss_sum / max(count, 1.0)
        objective = config.objective_config
        counted = "eval_tokens" if objective is None else f"eval_{objective.count_name}"
        writer.write({"step": step, "eval_loss": value, counted: int(count),
                      **{f"eval_{key}": mean for key, mean in means.items()}})
        if log.eval_generate_prompts:
            samples = _sample_completions(run.model(on_device=True), tokenizer, log)
            writer.write({"step": step, "samples": samples})
            for s in samples:
                logger.info("step %d sample: %r -> %r", step, s["prompt"], s["completion"])
        return value

    def diverged(problem: str) -> TrainingDiverged:
        kept = checkpointer.latest_step()
        kept = (f"the checkpoint of step {kept}" if kept is not None else "no checkpoint") + (
            f" and output_dir/{export}" if (out / export).exists() else "")
        return TrainingDiverged(
            f"training stopped: {problem}; lower learning_rate (now {config.optim.learning_rate:g}); "
            f"nothing of this state was saved ({kept} kept)", key="learning_rate")

    def check_pending(step: int) -> None:
        """At a sync point (eval, checkpoint, stop): the steps not yet logged, and the LoRA state, are sound."""
        problem = _unsound(jax.device_get([m for m, _ in window]), step - len(window) + 1)
        bad = problem or ckpt.first_nonfinite(ckpt.to_nested(run.lora), trained)
        if bad:
            raise diverged(problem or f"{bad} holds NaN or infinite values at step {step}")

    def save(step: int, force: bool = False):
        check_pending(step)
        path = checkpointer.save(step, run.lora, run.opt_state, meta_for(step), force=force)
        if path is not None:
            writer.write({"step": step, "checkpoint": str(path)})
        return path

    bar = _progress(plan.total_steps, start_step, disable=log.disable_tqdm or not main)
    meter = WindowMeter()
    last_loss, last_eval = None, None
    window: list[tuple[Any, int]] = []
    step = start_step
    status: dict[str, str] = {}
    try:
        with StopRequests() as stop:
            if eval_ds is not None and start_step == 0 and log.eval_strategy != "no":  # the baseline
                last_eval = evaluate(0)
                status["eval"] = f"eval {last_eval:.4f}"
                bar.set_postfix_str(status["eval"], refresh=False)
            if step < plan.total_steps:
                # Compiled ahead of time so that no logging window contains the compilation.
                try:
                    first = _local_batch(run, train_ds, step)
                    if not run.compiled_for(first):  # remat auto compiled it already
                        run.compile(first)
                except jax.errors.JaxRuntimeError as e:
                    raise _out_of_memory(e, config) from None
                logger.info("compiled the training step in %.1f s", run.compile_seconds)
            jax.block_until_ready((run.lora, run.opt_state))
            meter.start()
            while step < plan.total_steps:
                host = _local_batch(run, train_ds, step)  # this process's rows only
                batch_tokens = train_ds.num_tokens(step)  # the whole batch's
                try:
                    metrics = run.step(host, step)
                except jax.errors.JaxRuntimeError as e:
                    raise _out_of_memory(e, config) from None
                step += 1
                num_tokens += batch_tokens
                window.append((metrics, batch_tokens))
                if step % log.logging_steps == 0 or step == plan.total_steps:
                    last_loss, problem = _log_window(writer, status, meter, window, step, plan, num_tokens)
                    window = []
                    if problem:
                        raise diverged(problem)
                do_eval = eval_ds is not None and log.due("eval", step, plan.total_steps, plan.steps_per_epoch)
                do_save = log.due("save", step, plan.total_steps, plan.steps_per_epoch)
                stopping = _stop_agreed(stop.requested, step % log.logging_steps == 0 or do_eval or do_save)
                if stopping or do_eval or do_save:
                    with meter.paused(run.lora):  # syncs first: queued steps count as training time
                        if stopping:
                            path = save(step, force=True)
                            raise TrainingInterrupted(stop.requested, step, str(path) if path else None)
                        if do_eval:
                            last_eval = evaluate(step)
                            status["eval"] = f"eval {last_eval:.4f}"
                            if not math.isfinite(last_eval):
                                raise diverged(f"the eval loss is {last_eval} at step {step}")
                        if do_save:  # (by epoch: at steps the checkpointer's save_steps does not know)
                            save(step, force=step == plan.total_steps or log.save_strategy == "epoch")
                bar.set_postfix_str(", ".join(status.values()), refresh=False)
                bar.update(1)
    finally:
        bar.close()
        checkpointer.close()
        writer.close()

    bad = ckpt.first_nonfinite(ckpt.to_nested(run.lora), trained)
    if bad:  # (every step was checked; this guards the export itself)
        raise TrainingDiverged(f"{bad} holds NaN or infinite values after step {step}; output_dir/{export} is kept",
                               key="learning_rate")
    # ---- exports (every process takes part in their gathers, process 0 writes)
    curve = plot_loss_curve(read_metrics(writer.path), out / "loss_curve.png") if main else None
    adapter_dir = model_dir = merged_dir = None
    if run.full:
        model_dir = _export(out, "model", lambda d: run.export_merged(d, tokenizer=tokenizer))
    else:
        adapter_dir = _export(out, "adapter", lambda d: run.export_adapter(d, tokenizer=tokenizer))
    if config.logging.save_merged_model:
        merged_dir = _export(out, "merged", lambda d: run.export_merged(d, tokenizer=tokenizer))
    gguf_file = None
    if config.logging.save_gguf:
        name = f"model-{config.logging.save_gguf}.gguf"
        gguf_file = _export(out, "gguf", lambda d: run.export_gguf(d / name, config.logging.save_gguf,
                                                                   tokenizer=tokenizer)) / name
    tokens_per_s, step_s = meter.medians()
    summary = RunSummary(steps=step - start_step, num_tokens=num_tokens - setup.start_tokens,
                         median_tokens_per_second=tokens_per_s, median_step_seconds=step_s,
                         training_seconds=meter.training_seconds, compile_seconds=run.compile_seconds,
                         peak_memory_bytes=device_peak_bytes(), wall_seconds=time.perf_counter() - wall_start)
    logger.info("summary: %s", summary.line())
    if run.remat_choice is not None:
        chosen, estimate = run.remat_choice
        measured = ("not measured (the CPU keeps no allocator statistics)" if summary.peak_memory_bytes is None
                    else f"measured allocator peak {summary.peak_memory_bytes / 2**30:.3f} GiB")
        logger.info("remat auto: %s estimated peak %.3f GiB, %s", chosen, estimate / 2**30, measured)
    return TrainResult(output_dir=out, adapter_dir=adapter_dir, merged_dir=merged_dir, metrics_path=writer.path,
                       loss_curve=curve, checkpoint_dir=out / "checkpoints", global_step=step, train_loss=last_loss,
                       eval_loss=last_eval, resumed_from=resume_path, summary=summary, gguf_file=gguf_file,
                       model_dir=model_dir)


def _sample_completions(model, tokenizer, log: LoggingSection) -> list[dict[str, str]]:
    """Greedy completions of `eval_generate_prompts` by the model as trained so far (one compiled decode
    program, reused at every evaluation)."""
    prompts = list(log.eval_generate_prompts)
    completions = generate(model, tokenizer, prompts, max_new_tokens=log.eval_generate_max_new_tokens,
                           temperature=0.0, chat_template=True)
    return [{"prompt": p, "completion": c} for p, c in zip(prompts, completions)]


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"


def _run_identity(config: TrainConfig, run, train_ds) -> dict[str, Any]:
    """What a checkpoint's state means: the LoRA settings and the adapter's parameter shapes, the base model (its
    config.json and weight files' names and sizes: hashing the weights would cost a read of every byte) and the
    training data (`PackedDataset.fingerprint`). A resume that changes any of them is refused (`_check_identity`)."""
    lora = config.lora_config
    shapes = sorted(f"{jax.tree_util.keystr(path)}:{tuple(x.shape)}"
                    for path, x in jax.tree_util.tree_flatten_with_path(run.lora)[0])
    model_dir = Path(config.model.model_name_or_path).expanduser()
    weights = sorted(f"{p.name}:{p.stat().st_size}" for p in model_dir.glob("*.safetensors"))
    full = {"finetuning_type": "full"} if run.full else {}  # (a LoRA run's identity as before: its checkpoints resume)
    return {**full,
        "lora_r": lora.r, "lora_alpha": float(lora.alpha), "use_rslora": lora.use_rslora,
        "lora_target_modules": lora.target_modules if isinstance(lora.target_modules, str)
        else list(lora.target_modules),
        "lora_target_parameters": None if lora.target_parameters is None else list(lora.target_parameters),
        "rank_pattern": dict(lora.rank_pattern),
        "alpha_pattern": {k: float(v) for k, v in lora.alpha_pattern.items()},
        "lora_parameters": hashlib.sha256("\n".join(shapes).encode()).hexdigest(),
        "model": hashlib.sha256("\n".join([_file_digest(model_dir / "config.json"), *weights]).encode()).hexdigest(),
        "data": train_ds.fingerprint(),
    }


def _check_identity(meta: dict, identity: dict[str, Any]) -> None:
    """Refuses (one line, the differing keys) a checkpoint written for other LoRA settings, model or data."""
    path = meta.get("path") or "the checkpoint"
    recorded = meta.get("identity")
    if not isinstance(recorded, dict):
        logger.warning("%s records no run identity (written by an older jaxft): LoRA settings, model and data "
                       "cannot be checked against this run", path)
        return
    keys = sorted(set(recorded) | set(identity))
    changed = [k for k in keys if json.dumps(recorded.get(k), sort_keys=True) != json.dumps(identity.get(k),
                                                                                              sort_keys=True)]
    if changed:
        show = lambda v: f"{v[:12]}..." if isinstance(v, str) and len(v) == 64 else json.dumps(v)  # noqa: E731
        diffs = ", ".join(f"{k}: {show(recorded.get(k))} -> {show(identity.get(k))}" for k in changed)
        raise TrainConfigError(
            f"key 'resume_from_checkpoint': the checkpoint was written for another setup ({diffs}); resume with the "
            "settings, model and data it was written with, or start over (overwrite_output_dir=true or a new "
            "output_dir)", key="resume_from_checkpoint")


def _check_resume_meta(meta: dict, config: TrainConfig, plan: _Plan, num_rows: int) -> None:
    now = dict(rows_per_step=plan.rows_per_step, max_seq_length=config.model.max_seq_length, num_rows=num_rows,
               seed=config.optim.seed, total_steps=plan.total_steps)
    changed = {k: (meta.get(k), v) for k, v in now.items() if meta.get(k) != v}
    if changed:
        logger.warning("resuming with a different data setup than the checkpoint (%s): the run continues, but "
                       "the batches differ from an uninterrupted run",
                       ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items()))


def _out_of_memory(error: Exception, config: TrainConfig) -> Exception:
    """A device OOM becomes a one-line TrainConfigError naming the settings that trade memory for speed."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
        return error
    hints = []
    if config.execution_config.remat != "offload":
        hints.append(f"remat: offload (now {config.execution_config.remat!r}; layer inputs go to host memory)")
    hints.append(f"a smaller per_device_train_batch_size (now {config.data.per_device_train_batch_size}) with a "
                 f"larger gradient_accumulation_steps (now {config.optim.gradient_accumulation_steps})")
    hints.append(f"a shorter max_seq_length (now {config.model.max_seq_length})")
    first = text.strip().splitlines()[0][:300]
    return TrainConfigError(f"the training step ran out of device memory ({first}); try " + "; or ".join(hints))


def _unsound(host_metrics: list[dict[str, Any]], first_step: int) -> str | None:
    """What is wrong with the first unsound step of `host_metrics` (steps `first_step`, ...), or None.

    Unsound: a NaN or infinite loss or gradient norm, or a gradient norm of exactly 0 at a positive loss on
    target tokens. The LoRA B matrices start at zero but their gradients do not, so an exact 0 means the model is
    saturated (a learning rate far too high collapses it to the uniform prediction, loss ln(vocab)) and no further
    step can change it; a perfectly fitted batch has loss 0, not a positive one."""
    for i, m in enumerate(host_metrics):
        loss, norm = float(m["loss"]), float(m["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return f"the loss is {loss} (grad_norm {norm}) at step {first_step + i}"
        if norm == 0.0 and loss > 0.0 and float(m.get("num_target_tokens", 1)) > 0:
            return (f"the gradients are exactly zero at loss {loss:.4f} at step {first_step + i} (the model is "
                    "saturated and cannot learn)")
    return None


_STEP_METRICS = {"loss", "learning_rate", "grad_norm", "num_target_tokens"}  # what every step reports


def _log_window(writer, status: dict[str, str], meter: WindowMeter, window, step: int, plan: _Plan,
                num_tokens: int) -> tuple[float, str | None]:
    """Writes the train record of a finished window (after the sync that ends it); returns its mean loss, the
    number the progress bar, metrics.jsonl and the final summary all show, and what is unsound in the window
    (`_unsound`; read from the metrics this sync fetched anyway, so no step waits for the host)."""
    host, timed = meter.close([m for m, _ in window], sum(n for _, n in window))
    last = host[-1]
    record = {
        "step": step,
        "epoch": round(step / plan.steps_per_epoch, 4),
        "loss": float(np.mean([float(m["loss"]) for m in host])),
        "learning_rate": float(last["learning_rate"]),
        "grad_norm": float(last["grad_norm"]),
        "num_tokens": num_tokens,
        "window_tokens": timed.tokens,
        "step_seconds": timed.step_seconds,
        "tokens_per_second": timed.tokens_per_second,
    }
    for key in host[-1].keys() - _STEP_METRICS:  # the objective's own (DPO: rewards/*, logps/*, num_pairs)
        record[key] = float(np.mean([float(m[key]) for m in host]))
    peak = device_peak_bytes()
    if peak is not None:
        record["peak_memory_gib"] = round(peak / 2**30, 3)
    writer.write(record)
    status["loss"] = f"loss {record['loss']:.4f}"
    status["lr"] = f"lr {record['learning_rate']:.2e}"
    status["speed"] = f"{record['tokens_per_second']:,.0f} tok/s, {timed.step_seconds:.3f} s/step"
    if peak is not None:
        status["memory"] = f"peak {record['peak_memory_gib']:.1f} GiB"
    return record["loss"], _unsound(host, step - len(host) + 1)


def _progress(total: int, initial: int, *, disable: bool):
    return tqdm(total=total, initial=initial, disable=disable, unit="step", dynamic_ncols=True, desc="train")


def _local_batch(run, dataset, step: int) -> dict[str, np.ndarray]:
    """The rows of batch `step` this process feeds (one process: the whole batch)."""
    if jax.process_count() == 1:
        return dataset.batch(step)
    return dataset.batch(step, run.local_rows(dataset.batch_size))


def _local_batches(run, dataset):
    """This process's rows of each batch of `dataset`'s first epoch (the eval set, in order)."""
    slots = run.placement.local_rows(dataset.batch_size) if jax.process_count() > 1 else None
    return (dataset.batch(step, slots) for step in range(dataset.num_batches_per_epoch))


def _stop_agreed(requested: bool, at_sync_point: bool) -> bool:
    """Whether the run stops now (SIGINT/SIGTERM). Several processes must stop at the same step (the
    checkpoint is a collective), so they agree, at steps that sync anyway (logging, eval, save), on whether any
    of them was asked to stop."""
    if jax.process_count() == 1:
        return requested
    return at_sync_point and distributed.any_process(requested)


class _NoMetrics:
    """The metrics writer of a process other than 0: the records are process 0's to write."""

    def __init__(self, out: Path):
        self.path = out / "metrics.jsonl"

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def _export(out: Path, name: str, write) -> Path:
    """Runs `write(dir)` into `out/.<name>.new`, then swaps it in for `out/name` (`_swap_dir`). Other
    processes than 0 run `write` (its gathers are collectives) without writing anything."""
    if not distributed.is_main_process():
        write(out / name)
        return out / name
    new = out / f".{name}.new"  # the run holds output_dir's lock: a fixed name is ours alone
    shutil.rmtree(new, ignore_errors=True)
    try:
        write(new)
        _swap_dir(new, out / name)
    finally:
        shutil.rmtree(new, ignore_errors=True)
    return out / name
