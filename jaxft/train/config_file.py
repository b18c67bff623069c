"""A `TrainConfig` from a YAML file and `key=value` overrides: each key's line kept for the messages (`Where`),
a key written twice refused, YAML 1.2 floats (`1e-4` is a number)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from jaxft.train.config import TrainConfig
from jaxft.train.keys import ALIASES, COMMAND_LINE, TrainConfigError, Where


# Values a config may expand to through YAML aliases: a real config has hundreds; nested aliases (a "billion
# laughs" file of a few lines) reach billions, and would exhaust memory in from_dict and in error messages.
MAX_EXPANDED_VALUES = 100_000


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes under `node` with every alias expanded, counted without expanding (each node once, memoized)."""
    if id(node) not in memo:
        memo[id(node)] = 1  # (a recursive alias counts once, and PyYAML's constructor refuses it anyway)
        children = node.value if isinstance(node, yaml.CollectionNode) else ()
        parts = [c for pair in children for c in pair] if isinstance(node, yaml.MappingNode) else children
        memo[id(node)] = 1 + sum(_expanded_size(c, memo) for c in parts)
    return memo[id(node)]


def _check_size(node: yaml.Node, where: str) -> None:
    size = _expanded_size(node, {})
    if size > MAX_EXPANDED_VALUES:
        raise TrainConfigError(f"{where}: the YAML value expands to {size:,} values through aliases (*name), over "
                               f"the {MAX_EXPANDED_VALUES:,} a config may hold; write the values out")


def parse_value(text: str) -> Any:
    """A `key=value` override's value, read as YAML 1.2 scalars (so `1e-4` is a float, not a string)."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node, f"{COMMAND_LINE}: override value {text[:40]!r}")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Reads a YAML config and applies `key=value` overrides (later wins); `path` None: the overrides are the
    whole config, as `trl sft --model_name_or_path ... --dataset_name ...` takes it. Relative paths inside the
    file are kept as written (relative to the working directory), like TRL. An error about one key names
    where it was given: `FILE:LINE` for the file's keys, "command line" for overrides."""
    values: dict[Any, Any] = {}
    where: dict[Any, Where] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise TrainConfigError(f"config file {str(p)!r} does not exist; pass the path of a YAML file")
        values, lines = _read_mapping(p)
        where = {key: Where(str(p), lines.get(str(key))) for key in values}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise TrainConfigError(f"override {item!r}: expected key=value (e.g. learning_rate=1e-4)")
        key = ALIASES.get(key, key)
        try:
            value = parse_value(text)
        except yaml.YAMLError as e:
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise TrainConfigError(f"{COMMAND_LINE}: override {item!r}: the value is not valid YAML ({problem}); "
                                   f"quote it or fix the brackets", key=key) from None
        # An override replaces the file's value, whether the file spelled the key or its alias.
        values = {k: v for k, v in values.items() if ALIASES.get(k, k) != key}
        values[key] = value
        where[key] = Where(COMMAND_LINE)
    return TrainConfig.from_dict(values, source=str(path) if path is not None else COMMAND_LINE, where=where)


def _read_mapping(p: Path) -> tuple[dict[Any, Any], dict[str, int]]:
    """The YAML file's top-level mapping and the 1-based line of each key. The file is composed into nodes
    first (they carry the marks that plain `yaml.load` drops), then constructed. A key written twice is an
    error: PyYAML would silently keep the last value."""
    loader = _Loader(p.read_text(encoding="utf-8"))
    try:
        node = loader.get_single_node()
        if node is None:
            return {}, {}
        if not isinstance(node, yaml.MappingNode):
            got = type(loader.construct_document(node)).__name__
            raise TrainConfigError(f"{p}: expected a mapping of key: value at the top level, got {got}")
        lines: dict[str, int] = {}
        memo: dict[int, int] = {}
        for key_node, value_node in node.value:
            if _expanded_size(value_node, memo) > MAX_EXPANDED_VALUES:
                _check_size(value_node, f"{p}:{key_node.start_mark.line + 1}: key {key_node.value!r}")
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            line = key_node.start_mark.line + 1
            if key_node.value in lines:
                raise TrainConfigError(f"{p}:{line}: key {key_node.value!r} is given twice (also on line "
                                       f"{lines[key_node.value]}); keep one", key=key_node.value)
            lines[key_node.value] = line
        _check_size(node, str(p))  # the keys together
        return loader.construct_document(node), lines
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise TrainConfigError(f"{where}: invalid YAML ({problem}); fix the file") from None
    finally:
        loader.dispose()


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats: PyYAML (YAML 1.1) reads `1e-4` as a string."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                    |[-+]?\.(?:inf|Inf|INF)
                    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)
