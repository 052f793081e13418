"""K/V storage leaves: float arrays stored ``[L, H, C, D]``, written and read per cell.

Implementation modules are private; the public names are re-exported flat from :mod:`kvjax`.
"""
