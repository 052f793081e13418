"""Testing helpers shipped with kvjax: pure-Python reference models of the seed's memories.

They are deliberately naive (plain loops over cells, in cell order, as the seed runs them) and
independent of kvjax's vectorized code, so a property test can run one beside a memory and
compare every cell.
"""

from kvjax.testing import _defrag_reference as defrag_reference
from kvjax.testing._hybrid_reference import HybridRef as HybridRef
from kvjax.testing._iswa_reference import IswaRef as IswaRef
from kvjax.testing._recurrent_reference import RecurrentRef as RecurrentRef
from kvjax.testing._streams_reference import StreamsRef as StreamsRef
from kvjax.testing._unified_reference import Cell as Cell
from kvjax.testing._unified_reference import UnifiedRef as UnifiedRef

__all__ = ["Cell", "UnifiedRef", "IswaRef", "RecurrentRef", "HybridRef", "StreamsRef", "defrag_reference"]
