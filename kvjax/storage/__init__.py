"""K/V storage leaves: float arrays stored ``[L, H, C, D]``, or ggml block types stored as each
cell's blocks ``u8[L, H, C, D // 32 * bytes]``; written and read per cell.

Implementation modules are private; the public names are re-exported flat from :mod:`kvjax`.
"""
