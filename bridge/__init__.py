"""HF checkpoint I/O for jaxft (never imports jaxft).

Public API:
  read_config(path) -> dict (a .gguf file: the config its metadata describes)
  load_weights(path, table, expected, num_layers, dtype=None) -> {path_tuple: np.ndarray}
  WeightSlices(path, table, expected, num_layers, dtype=None).read(path_tuple, index): one slice, from the files
  save_weights(path, table, params, num_layers, config, max_shard_bytes=5e9, dtype=None, *, overwrite=False)
  hf_tensors(table, params, num_layers) -> (HF name, array) pairs, what save_weights writes
  bridge.gguf: GGUF files (llama.cpp) out (write_gguf) and in (read_config, read_tensors, tree_arrays)
  table_for(model_type) / TABLES / Row: name-mapping tables (bridge.mappings)
  flatten_tree / unflatten_tree: nested dict <-> {path_tuple: leaf}
  CheckpointError: bad checkpoint on disk (a ValueError)
"""

from bridge.errors import CheckpointError
from bridge.hf import checkpoint_files, hf_tensors, load_weights, read_config, save_weights
from bridge.mappings import TABLES, Row, Table, table_for
from bridge.slices import WeightSlices
from bridge.tree import flatten_tree, unflatten_tree

__all__ = [
    "CheckpointError",
    "checkpoint_files",
    "Row",
    "TABLES",
    "Table",
    "WeightSlices",
    "flatten_tree",
    "hf_tensors",
    "load_weights",
    "read_config",
    "save_weights",
    "table_for",
    "unflatten_tree",
]
