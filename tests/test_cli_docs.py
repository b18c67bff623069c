"""docs/cli.md and `jaxft-train --help` are rendered from TrainConfig's field help (`jaxft.train.config_docs`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from jaxft.cli import main
from jaxft.train import TrainConfig
from jaxft.train.config import ALIASES
from jaxft.train.config_docs import REGENERATE, key_rows, render_cli_markdown, type_name

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_cli_page_is_the_rendered_key_table():
    assert CLI_DOC.read_text(encoding="utf-8") == render_cli_markdown(), (
        f"docs/cli.md is stale: regenerate it with `{REGENERATE}` from the repository root")


def test_every_key_has_one_row_with_its_type_default_and_help():
    page = render_cli_markdown()
    fields = dataclasses.fields(TrainConfig)
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [f.name for f in fields]
    for f in fields:
        assert f.metadata["help"].strip() and "\n" not in f.metadata["help"], f.name
    row = dict((r.split("`")[1], r) for r in rows)
    assert row["lr_scheduler_type"] == (
        "| `lr_scheduler_type` | linear \\| cosine \\| constant \\| constant_with_warmup | `linear` | learning-rate "
        "decay after warm-up |")
    assert row["model_name_or_path"].split(" | ")[1:3] == ["str", "required"]
    assert row["eval_dataset"].split(" | ")[1:3] == ["str or null", "`null`"]
    assert row["packing"].split(" | ")[1:3] == ["bool", "`true`"]
    for alias, name in ALIASES.items():
        assert f"`{alias}` = `{name}`" in page


def test_type_names_read_as_yaml():
    assert type_name(int | None) == "int or null"
    assert type_name(list[str] | None) == "list of str or null"
    assert type_name(str | dict | None) == "str or mapping or null"
    assert type_name(Literal["a", "b"]) == "a \\| b"


def test_a_key_without_help_is_refused():
    @dataclasses.dataclass
    class Undocumented:
        documented: int = dataclasses.field(default=1, metadata={"help": "has help"})
        bare: int = 2

    with pytest.raises(ValueError, match="field 'bare' has no help"):
        key_rows(Undocumented)


def test_help_lists_every_key_with_the_same_help(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for f in dataclasses.fields(TrainConfig):
        assert f" {f.name} (" in out, f.name
        assert " ".join(f.metadata["help"].split()) in out, f.name
    assert "lr_scheduler_type (linear | cosine | constant | constant_with_warmup; default linear)" in out
