"""The LoRA training benchmark, the scoreboard: jaxft vs HF transformers + PEFT vs Unsloth on the same model, data,
LoRA and optimizer. Run from the repository root as modules:

    python -m scripts.bench.train --tiny --systems hf_nockpt,jaxft --out /tmp/b.json   # train.py says more

Modules (import them directly; this package deliberately imports nothing at import time, because
the Unsloth worker must import unsloth before transformers/peft and ceiling runs on its own):
  train          the command line: arguments, the report, a resumed table
  jaxft_worker   the jaxft side: a recipe of examples/bench/ through jaxft.run.Run, timed
  torch_worker   the torch side: HF transformers + PEFT, and Unsloth
  workloads      workloads, LoRA/AdamW settings, the FLOP formula; re-exports the next two
  shapes         the model shapes (HF config dicts of the real models and of tiny ones)
  token_data     the seeded token data (and a VLM row's image) every system trains on
  worker_common  the harness <-> worker contract (Task, sessions of tasks, worker_main, ModelCache)
  sessions       worker processes: sessions with timeouts and continuation, side by side on several GPUs
  harness        train's run (Bench): ceilings, model saves, a session per system and shape
  gpus           the host's GPUs (nvidia-smi, or fake ones for tests) and --gpus
  models         random-weight model directories (save_pretrained) + a generated tokenizer
  ceiling        the bf16 matmul ceiling (torch or JAX), runnable as a script
  report         derived statistics (median, tokens/s, MFU) and the markdown table
  profile        a JAX profiler trace joined with the optimized HLO: time per category and scope
"""
