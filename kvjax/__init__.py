"""kvjax: a JAX-native, purely functional KV cache with the semantics of llama.cpp's KV cache.

The cache is an immutable pytree (:class:`KVCache`); every operation is a pure function that
returns a new cache and runs jitted on the accelerator. Shape letters used in the docstrings are
explained in :mod:`kvjax._typing`.

Example:
    >>> import kvjax
    >>> cfg = kvjax.CacheConfig(size=256, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=16)
    >>> cache = kvjax.init(cfg)
    >>> cache, slot, ok = kvjax.find_slot(cache, kvjax.make_ubatch([0, 1, 2], [[0], [0], [0]]))
    >>> int(kvjax.used_cells(cache)), int(kvjax.n_kv(cache))
    (3, 32)
"""

from kvjax.memory._unified import KVCache, size_cells_bytes, size_k_bytes, size_v_bytes, total_size, view, write
from kvjax.memory._iswa import IswaCache, IswaConfig
from kvjax.memory._recurrent import RecurrentCache, RecurrentConfig, RecurrentPlacement
from kvjax.memory._hybrid import HybridCache, HybridConfig
from kvjax.memory._streams import StreamCache, StreamPlacement, StreamsConfig
from kvjax.memory._init import abstract, init
from kvjax.memory._cells import Cells
from kvjax.memory._config import CacheConfig, LayerGroup, RopeConfig, RopeMode, SwaType
from kvjax.memory._defrag import DefragPlan, compact, compact_seq, defrag, defrag_plan, defrag_sched, fragmentation
from kvjax._errors import CacheFullError, ErrorFlag, StateError
from kvjax._inspect import CellTable, cell_map, cell_table
from kvjax.memory._protocol import Memory, NotDefinedError
from kvjax.memory._api import (
    can_shift,
    cell_max,
    check,
    clear,
    clear_errors,
    commit,
    errors,
    find_slot,
    has_shift,
    n_kv,
    n_tokens,
    pos_max,
    prepare,
    seq_add,
    seq_cp,
    seq_div,
    seq_keep,
    seq_pos_max,
    seq_pos_min,
    seq_rm,
    used_cells,
    kv_window,
    update,
)
from kvjax.memory._ubatch import (
    Ubatch,
    bucket_length,
    make_equal_ubatch,
    make_ubatch,
    split_equal,
    split_seq,
    split_simple,
)
from kvjax.memory._part_ops import attention, k_shift, kq_mask, kq_mask_bool, pos_bucket
from kvjax.attn._rope import rope
from kvjax.memory._stream_attention import attend as stream_attend, attention as stream_attention, masks as stream_masks
from kvjax.attn._windows import window_bucket, window_buckets
from kvjax.memory._sink_window import SinkWindow, sink_window_evict
from kvjax.io._state import state_read, state_write
from kvjax.io._session import load, save
from kvjax.io._checkpoint import checkpoint_restore, checkpoint_save
from kvjax.io._llama_state import (
    LlamaSession,
    seq_file_read,
    seq_file_write,
    seq_save_file,
    session_read,
    session_save_file,
    session_write,
    stream_state_read,
    stream_state_write,
)
from kvjax.engine._sampling import SamplingConfig, sample
from kvjax._compiles import CompileCounter

# The decode driver needs Flax (kvjax.nn); import it on first use so `import kvjax` stays light.
_LAZY = {
    "Engine": "kvjax.engine._engine",
    "generate": "kvjax.engine._generate",
    "generate_stream": "kvjax.engine._generate",
    "PromptCache": "kvjax.engine._prompt_cache",
    "GenerationResult": "kvjax.engine._generate",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvjax' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    # config and cache
    "CacheConfig",
    "RopeConfig",
    "RopeMode",
    "SwaType",
    "LayerGroup",
    "KVCache",
    "Cells",
    "IswaConfig",
    "IswaCache",
    "RecurrentConfig",
    "RecurrentCache",
    "RecurrentPlacement",
    "HybridConfig",
    "HybridCache",
    "StreamsConfig",
    "StreamCache",
    "StreamPlacement",
    "init",
    "abstract",
    "size_k_bytes",
    "size_v_bytes",
    "size_cells_bytes",
    "total_size",
    # sequence operations and queries
    "clear",
    "seq_rm",
    "seq_cp",
    "seq_keep",
    "seq_add",
    "seq_div",
    "seq_pos_min",
    "seq_pos_max",
    "pos_max",
    "n_tokens",
    "used_cells",
    "cell_max",
    "n_kv",
    "has_shift",
    # ubatches and placement
    "Ubatch",
    "make_ubatch",
    "make_equal_ubatch",
    "bucket_length",
    "split_simple",
    "split_equal",
    "split_seq",
    "find_slot",
    "prepare",
    "commit",
    # the memory protocol
    "Memory",
    "NotDefinedError",
    # K/V rows
    "write",
    "view",
    # the attention path: masks, RoPE, K-shift, attention, window buckets, update
    "kq_mask",
    "kq_mask_bool",
    "pos_bucket",
    "rope",
    "k_shift",
    "can_shift",
    "update",
    "attention",
    "window_bucket",
    "window_buckets",
    "kv_window",
    "stream_masks",
    "stream_attention",
    "stream_attend",
    # defragmentation
    # sink + window eviction (StreamingLLM): bounded cells per sequence, forever
    "SinkWindow",
    "sink_window_evict",
    "fragmentation",
    "defrag_sched",
    "defrag",
    "defrag_plan",
    "DefragPlan",
    "compact",
    "compact_seq",
    # state: the seed's byte format, session files, orbax checkpoints
    "state_write",
    "state_read",
    "save",
    "load",
    "checkpoint_save",
    "checkpoint_restore",
    # today's llama.cpp state layout (stream counts; 'ggsn' session and 'ggsq' sequence files)
    "stream_state_write",
    "stream_state_read",
    "session_write",
    "session_read",
    "seq_file_write",
    "seq_file_read",
    "session_save_file",
    "seq_save_file",
    "LlamaSession",
    # generation: the decode driver, sampling
    "Engine",
    "generate",
    "generate_stream",
    "GenerationResult",
    "PromptCache",
    "SamplingConfig",
    "sample",
    "CompileCounter",
    # inspection and errors
    "cell_table",
    "cell_map",
    "CellTable",
    "errors",
    "check",
    "clear_errors",
    "CacheFullError",
    "StateError",
    "ErrorFlag",
]
