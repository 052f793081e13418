"""Pure-Python reference models of the seed's memories, for tests that compare kvjax cell by cell.

Deliberately naive loops over cells in the seed's order, independent of kvjax's vectorized code.
"""

from kvjax.testing._iswa_reference import IswaRef as IswaRef
from kvjax.testing._recurrent_reference import RecurrentRef as RecurrentRef

__all__ = ["IswaRef", "RecurrentRef"]
