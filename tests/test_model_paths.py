"""Model paths a new user gets wrong: a Hub id instead of a local directory (every entry point says how to
download it), and pickle checkpoints / adapters, whose hinted conversion command must produce something
jaxft then loads (the test runs exactly the command from the message)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from test_train_fixtures import make_tiny_model

import bridge
import jaxft
from bridge.peft import AdapterError
from jaxft.cli import main
from jaxft.data import DataPathError, load_tokenizer
from jaxft.train import TrainConfig, TrainConfigError

HUB_ID = "meta-llama/Llama-3.2-1B"
DOWNLOAD = f"only local directories are read; download with `hf download {HUB_ID} --local-dir DIR`"
OLD_CLI = f"`huggingface-cli download {HUB_ID} --local-dir DIR`"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama + tokenizer (safetensors) and a copy of it as a legacy pickle checkpoint."""
    root = tmp_path_factory.mktemp("paths")
    model_dir = make_tiny_model(root / "model")
    pickled = root / "pickled"
    hf = _hf_model(model_dir)
    hf.config.save_pretrained(pickled)
    # What transformers 4 wrote with safe_serialization=False (transformers 5 writes safetensors whatever
    # it is told): the state dict pickled as pytorch_model.bin, beside the tokenizer files.
    torch.save(hf.state_dict(), pickled / "pytorch_model.bin")
    load_tokenizer(model_dir).save_pretrained(pickled)
    return model_dir, pickled


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


def _hinted_command(message: str) -> list[str]:
    """The command between backticks after "convert it once with", as argv with this interpreter."""
    m = re.search(r"[Cc]onvert it once with `([^`]+)`", message)
    assert m, message
    argv = shlex.split(m.group(1))
    assert argv[0] == "python", argv
    return [sys.executable, *argv[1:]]


def _logits(model, ids: np.ndarray) -> np.ndarray:
    return np.asarray(model(ids, positions=None, segment_ids=None), np.float32)


IDS = np.array([[1, 5, 9, 12, 7, 3, 22, 40]], np.int32)


# ---- Hub ids -----------------------------------------------------------------------------


def test_train_config_names_the_download_command(tiny, tmp_path):
    model_dir, _ = tiny
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hi"}\n')
    with pytest.raises(TrainConfigError) as e:
        TrainConfig(model_name_or_path=HUB_ID, dataset=str(data), output_dir=str(tmp_path / "out"))
    msg = str(e.value)
    assert msg.startswith(f"key 'model_name_or_path': path '{HUB_ID}' does not exist; {DOWNLOAD}"), msg
    assert OLD_CLI in msg
    with pytest.raises(TrainConfigError, match=r"key 'dataset': path 'trl-lib/Capybara' does not exist; only "
                       r"local files and directories are read; download with `hf download trl-lib/Capybara "
                       r"--repo-type dataset --local-dir DIR`"):
        TrainConfig(model_name_or_path=str(model_dir), dataset="trl-lib/Capybara", output_dir=str(tmp_path / "o"))
    # A path that is not a Hub id keeps the plain message.
    with pytest.raises(TrainConfigError, match=r"path '\./no/such/model' does not exist; fix the path$"):
        TrainConfig(model_name_or_path="./no/such/model", dataset=str(data), output_dir=str(tmp_path / "o"))


def test_cli_names_the_download_command(tiny, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hi"}\n')
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(dict(model_name_or_path=HUB_ID, dataset=str(data), output_dir=str(tmp_path / "o"))))
    assert main([str(cfg)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("jaxft-train: error:")]
    assert DOWNLOAD in line and OLD_CLI in line, err


def test_python_api_names_the_download_command(tiny):
    model_dir, _ = tiny
    for load in (bridge.read_config, jaxft.from_pretrained):
        with pytest.raises(bridge.CheckpointError) as e:
            load(HUB_ID)
        assert f"checkpoint path {HUB_ID} does not exist; {DOWNLOAD}" in str(e.value)
    with pytest.raises(DataPathError, match=re.escape(DOWNLOAD)):
        load_tokenizer(HUB_ID)
    with pytest.raises(AdapterError, match=re.escape("only local directories are read; download with "
                                                     "`hf download someone/tiny-lora --local-dir DIR`")):
        jaxft.load_adapter(jaxft.from_pretrained(model_dir, dtype="float32"), "someone/tiny-lora")
    # Not Hub ids: an absolute path, and a relative path with more than one part.
    for path in ("/no/such/model", "no/such/model"):
        with pytest.raises(bridge.CheckpointError, match=r"does not exist; pass a local HF model directory$"):
            bridge.read_config(path)


# ---- pickle checkpoints ------------------------------------------------------------------


def test_pickle_model_hint_converts_to_a_directory_jaxft_loads(tiny, tmp_path):
    model_dir, pickled = tiny
    with pytest.raises(bridge.CheckpointError) as e:
        jaxft.from_pretrained(pickled, dtype="float32")
    msg = str(e.value)
    out = pickled.with_name(pickled.name + "-safetensors")
    assert msg.endswith(f"then load {out}"), msg
    done = subprocess.run(_hinted_command(msg), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr

    converted = jaxft.from_pretrained(out, dtype="float32")
    with torch.no_grad():
        expected = _hf_model(model_dir)(torch.from_numpy(IDS).long()).logits.numpy()
    np.testing.assert_allclose(_logits(converted, IDS), expected, rtol=1e-4, atol=1e-5)
    text = "reverse: cat dog sun"
    assert load_tokenizer(out)(text)["input_ids"] == load_tokenizer(model_dir)(text)["input_ids"]


def test_pickle_adapter_hint_converts_to_an_adapter_jaxft_loads(tiny, tmp_path):
    import peft

    model_dir, _ = tiny
    torch.manual_seed(0)
    hf_peft = peft.get_peft_model(_hf_model(model_dir), peft.LoraConfig(r=2, lora_alpha=4,
                                                                        target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in hf_peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)  # B starts at zero: make the adapter change the logits
    adapter = tmp_path / "adapter"
    hf_peft.save_pretrained(adapter, safe_serialization=False)
    assert (adapter / "adapter_model.bin").is_file() and not (adapter / "adapter_model.safetensors").exists()

    base = jaxft.from_pretrained(model_dir, dtype="float32")
    with pytest.raises(AdapterError) as e:
        jaxft.load_adapter(base, adapter)
    msg = str(e.value)
    done = subprocess.run(_hinted_command(msg), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr

    tuned = jaxft.load_adapter(base, adapter)
    with torch.no_grad():
        expected = hf_peft(torch.from_numpy(IDS).long()).logits.numpy()
        plain = _hf_model(model_dir)(torch.from_numpy(IDS).long()).logits.numpy()
    assert not np.allclose(expected, plain, atol=1e-3)
    np.testing.assert_allclose(_logits(tuned, IDS), expected, rtol=1e-4, atol=1e-5)
