"""The attention path: masks, RoPE maths and the K-shift, attention over a memory, window buckets.

Implementation modules are private; the public names are re-exported flat from :mod:`kvjax`.
"""
