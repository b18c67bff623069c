"""Tests of the lab's tools: `python -m pytest experiments/tests/test_x.py` from the repository root."""
