"""Exception type for checkpoint problems, and helpers for the hints in messages (Hub ids, commands)."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

# A Hub repo id: "owner/name" (letters, digits, "-", "_", "."), as written in model cards.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


class CheckpointError(ValueError):
    """A checkpoint on disk is missing, unreadable or does not match the model.

    Messages name the file, the tensor and the fix.
    """


def hub_id_hint(path: str | os.PathLike, *, repo_type: str = "model") -> str:
    """``"; only local directories are read; download with ..."`` when ``path`` does not exist and
    looks like a Hugging Face Hub id (``meta-llama/Llama-3.2-1B``), else ``""``.

    Nothing here downloads: jaxft reads local files only, so a Hub id gets the command that fetches
    it. ``repo_type`` is "model" or "dataset" (datasets need ``--repo-type dataset``).
    """
    text = os.fspath(path)
    if not _HUB_ID.fullmatch(text) or ".." in text or Path(text).expanduser().exists():
        return ""
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    local = "directories" if repo_type == "model" else "files and directories"
    return (f"; only local {local} are read; download with `hf download {text}{kind} --local-dir DIR` "
            f"(older huggingface_hub: `huggingface-cli download {text}{kind} --local-dir DIR`) and pass DIR")


def python_command(code: str, **paths: str | os.PathLike) -> str:
    """``python -c '<code>'`` for a hint, ready to paste into a shell: ``{NAME}`` in ``code`` becomes the
    Python string literal of ``paths[NAME]`` (double-quoted, so the shell quoting can be single quotes)."""
    for name, value in paths.items():
        code = code.replace("{" + name + "}", json.dumps(os.fspath(value)))
    return f"python -c {shlex.quote(code)}"
