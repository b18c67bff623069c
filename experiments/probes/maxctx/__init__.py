"""The pieces of experiments/probes/max_context.py, which re-exports their public names. Nothing is imported here
(import the modules), and no module imports JAX or jaxft at import time: the script sets the device up first.
  search   search_max: the longest length whose load fits, by secant steps inside a bracket
  probes   the policies, the step's Settings and Run, one probe (a compile from shapes: device and host bytes),
           a policy's search over probes (search_policy) and the real step on random weights
  table    the derived rows (auto's from its candidates', Unsloth's from its measured peaks) and the markdown table
"""
