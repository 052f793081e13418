"""The demo application (its character model, corpus and weights) and the benchmark runner.

Not part of the library: nothing in :mod:`kvjax` imports it; ``python -m kvjax`` does.
"""
