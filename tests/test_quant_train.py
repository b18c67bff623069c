"""QLoRA from `jaxft-train`'s config: the 4-bit keys (transformers' BitsAndBytesConfig names) are validated
with one line each, and a short run of examples/qlora.yaml trains adapters on a 4-bit base whose PEFT export
loads onto the same base quantised by transformers + bitsandbytes with equal logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("bitsandbytes")
import peft  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import yaml  # noqa: E402

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jaxft  # noqa: E402
from jaxft.models.layers import Quant4bit  # noqa: E402
from jaxft.train import TrainConfig, train  # noqa: E402
from jaxft.train.config import TrainConfigError  # noqa: E402
from bnb_helpers import cpu_4bit_logit_tol  # noqa: E402
from lora_helpers import rel_err  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "qlora.yaml"


def _config(tmp_path, **overrides) -> TrainConfig:
    values = yaml.safe_load(EXAMPLE.read_text())
    for key in ("model_name_or_path", "dataset", "eval_dataset"):
        values[key] = str(ROOT / values[key])
    values.update(output_dir=str(tmp_path / "run"), **overrides)
    return TrainConfig(**values)


def test_4bit_keys_are_validated(tmp_path):
    cfg = _config(tmp_path)
    quant = cfg.quant_config
    assert quant.quant_type == "nf4" and quant.double_quant and "lm_head" in quant.skip_modules
    assert _config(tmp_path, load_in_4bit=False, bnb_4bit_use_double_quant=False).quant_config is None
    with pytest.raises(TrainConfigError, match="key 'bnb_4bit_use_double_quant' is set but load_in_4bit is false"):
        _config(tmp_path, load_in_4bit=False)
    with pytest.raises(TrainConfigError, match="key 'bnb_4bit_quant_type': value 'int4' is not one of"):
        _config(tmp_path, bnb_4bit_quant_type="int4")
    with pytest.raises(TrainConfigError, match=r"key 'bnb_4bit_max_rel_error': value 2\.0 is invalid"):
        _config(tmp_path, bnb_4bit_max_rel_error=2.0)


def test_qlora_run_exports_an_adapter_peft_loads_on_bitsandbytes(tmp_path):
    evals = tmp_path / "eval.jsonl"  # the example's first 8 held-out chats: the eval path runs, in a few batches
    evals.write_text("".join((ROOT / "examples/data/eval.jsonl").read_text().splitlines(keepends=True)[:8]))
    cfg = _config(tmp_path, max_steps=4, logging_steps=2, eval_steps=4, save_steps=4, max_seq_length=128,
                  per_device_train_batch_size=2, per_device_eval_batch_size=2, eval_dataset=str(evals))
    train(cfg)
    adapter = Path(cfg.logging.output_dir) / "adapter"
    # The same base quantised by transformers + bitsandbytes, saved: PEFT's side and (loaded as stored) jaxft's.
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                        bnb_4bit_compute_dtype=torch.float32)
    transformers.AutoModelForCausalLM.from_pretrained(cfg.model.model_name_or_path, quantization_config=q,
                                                      device_map="cpu", dtype=torch.float32).save_pretrained(tmp_path / "bnb")
    ours = jaxft.load_adapter(jaxft.from_pretrained(tmp_path / "bnb", dtype="float32"), adapter)
    assert isinstance(ours.layers.mlp.up_proj.quant, Quant4bit)
    b = np.asarray(ours.layers.mlp.up_proj.lora_b[...])
    assert np.abs(b).max() > 0  # trained away from PEFT's B = 0, or the comparison proves nothing
    ids = np.random.default_rng(0).integers(0, ours.config.vocab_size, (1, 512)).astype(np.int32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bnb", device_map="cpu", dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, adapter).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    got = np.asarray(nnx.jit(lambda m, x: m(x))(ours, jnp.asarray(ids)))
    assert rel_err(got, ref) < cpu_4bit_logit_tol(1e-5)  # bitsandbytes' CPU kernel may compute in bf16
