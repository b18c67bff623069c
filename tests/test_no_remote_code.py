"""No Python file from a model folder ever runs: the tokenizer and image-processor loaders refuse an `auto_map`
that points at the folder's own code, even when stdin answers "y" to transformers' trust prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_train_fixtures import make_tokenizer

REPO = Path(__file__).resolve().parents[1]
EVIL = """import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast, BaseImageProcessor
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
class EvilProcessor(BaseImageProcessor):
    pass
"""


def _folder(tmp_path: Path) -> tuple[Path, Path]:
    d, marker = tmp_path / "model", tmp_path / "marker"
    make_tokenizer().save_pretrained(d)
    (d / "evil.py").write_text(EVIL.format(marker=str(marker)), encoding="utf-8")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "EvilTokenizer"  # no class of that name in transformers: only the folder has it
    cfg["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "EvilProcessor", "auto_map": {"AutoImageProcessor": "evil.EvilProcessor"}}))
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "image_token_id": 5,
                                               "auto_map": {"AutoConfig": "evil.EvilConfig"}}))
    return d, marker


def test_auto_map_code_in_a_model_folder_never_runs(tmp_path):
    """Both loaders in one process (a process: transformers' trust prompt reads stdin)."""
    d, marker = _folder(tmp_path)
    code = ("from jaxft.data.formatting import load_tokenizer\nfrom jaxft.data.images import ImageProcessor\n"
            "for f in (load_tokenizer, ImageProcessor.from_model_dir):\n    try:\n"
            f"        f({str(d)!r})\n    except ValueError as e:\n        print(f.__name__, 'refused:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, input="y\n" * 6, capture_output=True, text=True,
                          timeout=300)
    assert not marker.exists(), f"the model folder's evil.py ran: {proc.stdout[-2000:]} {proc.stderr[-2000:]}"
    assert proc.returncode == 0, proc.stderr[-3000:]
