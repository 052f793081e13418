"""Array type aliases and the legend of shape letters used in every docstring.

Shape letters (used in docstrings and jaxtyping annotations throughout kvjax):

    C   number of cells in the cache (``config.size``), a multiple of ``padding``
    W   words of the sequence bitmask, ``ceil(n_seq_max / 32)``
    S   ``n_seq_max``, the number of sequence ids
    T   tokens of a ubatch (its static length bucket, padding included)
    L   layers of one layer group (layers with the same K/V shapes, stacked)
    H   kv heads of a layer (``n_kv_heads``)
    Hq  query heads (a multiple of H)
    D   head size of K (``head_dim``); Dv: head size of V
    N   the attention window ``n_kv`` (a multiple of ``padding``, at most C)

Storage layout of one layer group: ``k [L, H, C, D]``, ``v [L, H, C, Dv]``
(heads before cells, because decode attention reads that layout fastest on XLA;
see ``docs/architecture.md``).
"""

from __future__ import annotations

from typing import Union

import jax
import numpy as np
from jaxtyping import Array, Bool, Float, Int, UInt32

#: Anything that can stand for an int32 scalar argument: a Python int, a numpy or
#: jax scalar, or a traced value inside ``jit``.
IntLike = Union[int, np.integer, jax.Array]

__all__ = ["Array", "Bool", "Float", "Int", "UInt32", "IntLike"]
