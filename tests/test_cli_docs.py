"""docs/cli.md and `jaxft-train --help` are rendered from the keys table (`jaxft.train.keys`, by
`jaxft.train.config_docs`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from jaxft.cli import main
from jaxft.train.config_docs import REGENERATE, key_rows, render_cli_markdown
from jaxft.train.keys import ALIASES, KEYS, SECTIONS, Key, type_name

CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_cli_page_is_the_rendered_key_table():
    assert CLI_DOC.read_text(encoding="utf-8") == render_cli_markdown(), (
        f"docs/cli.md is stale: regenerate it with `{REGENERATE}` from the repository root")


def test_every_key_has_one_row_with_its_type_default_and_help():
    page = render_cli_markdown()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [k.name for k in KEYS]
    # One table per section, under its heading, in the order of SECTIONS.
    headings = [line.split("`")[1] for line in page.splitlines() if line.startswith("## `")]
    assert headings == list(SECTIONS)
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


def test_a_key_without_one_line_of_help_is_refused():
    documented = Key("documented", "model", int, 1, "has help")
    for bad in ("", "two\nlines"):
        with pytest.raises(ValueError, match="key 'bare' has no one-line help"):
            key_rows((documented, dataclasses.replace(documented, name="bare", help=bad)))


def test_help_lists_every_key_with_the_same_help(capsys):
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for k in KEYS:
        assert f" {k.name} (" in out, k.name
        assert " ".join(k.help.split()) in out, k.name
    assert "lr_scheduler_type (linear | cosine | constant | constant_with_warmup; default linear)" in out
