"""Pure-Python reference models of the seed's memories, for tests that compare kvjax cell by cell.

Deliberately naive loops over cells in the seed's order, independent of kvjax's vectorized code.
"""

from kvjax.testing._iswa_reference import IswaRef as IswaRef

__all__ = ["IswaRef"]
