"""The jitted model step: place a ubatch, run the model through the cache, donate the K/V buffers.

One :class:`Step` holds one ``jax.jit`` program per ``(ubatch bucket, window bucket)``: the
ubatch bucket is the ubatch's static shape (length T and sequence-id width M), the window bucket
the static ``n_kv``. Everything else (tokens, positions, sequence ids, the cells, the weights) is
traced, so new values never recompile.

**Who places the ubatch.** The step does: it calls ``kvjax.find_slot`` inside the compiled
program (one dispatch per ubatch instead of two) and returns ``ok``. When ``ok`` is false the
returned cache equals the one passed in (the placement refused, every write was dropped): raise
``kvjax.CacheFullError`` and go on with the returned value. A caller that placed the ubatch
already (to look at the slots first) passes ``slot=`` and the step skips placement. (The seed
places each ubatch on the host before it builds the graph; here placement is part of the
compiled program, which is why the window is chosen before it, below.)

**Which window.** ``n_kv`` (``windows=``, one per attention part, for memories with several) must cover every cell the ubatch may land in, so it is chosen on the
host before the call:

- with a dry run of the whole batch (``ok, slots = kvjax.prepare(cache, ubatches)``, what the
  decode driver does), :func:`windows_for` gives the exact window of each ubatch from the slots;
- without one, :func:`window_for` gives a safe bound from the cache's ``cell_max`` and ``head``
  (one small device read): placement never goes past ``max(cell_max, head) + n_tokens``.

Both round up with ``kvjax.window_bucket`` so the number of programs stays small.

**Which rows get logits.** ``outputs=`` (``i32[R]`` ubatch rows, llama.cpp's output ids) runs
the final norm and the output projection on those rows only and returns ``[R, V]``; without it
every row's logits come back (``[T, V]``). A prefill that needs the last row only then costs
``T x E`` for the head's input instead of ``T x V``. ``R`` is part of the program's shape (pad it
with :func:`output_bucket`), the row values are not.

**Donation.** The K/V buffers of the cache passed in are donated (updated in place): use the
returned cache, never the old one, after a step. The cells are not donated, so a reference to
``cache.cells`` kept before the step is a valid snapshot to restore on failure (the seed's
``restore``), as ``docs/architecture.md`` describes.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig, make_step, window_for
    >>> cfg = LlamaConfig(vocab_size=64, d_model=32, n_layer=1, n_heads=4, n_kv_heads=2)
    >>> model = Llama(cfg, rngs=nnx.Rngs(0))
    >>> step, state = make_step(model), nnx.state(model)
    >>> cache = kvjax.init(cfg.cache_config(size=64, n_seq_max=2))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0], [1], [1]])
    >>> logits, cache, ok = step(state, cache, ub, jnp.array([3, 4, 5, 0]), n_kv=window_for(cache, 3))
    >>> logits.shape, bool(ok), int(kvjax.used_cells(cache))
    ((4, 64), True, 3)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax._typing import Array, Bool, Float, Int
from kvjax._errors import ErrorFlag
from kvjax._validate import INT32_MAX, check_count, check_flag, check_window
from kvjax.memory._init import require_memory
from kvjax.memory._protocol import Memory, Placement
from kvjax.memory._ubatch import Ubatch
from kvjax.nn._inputs import UbatchInputs, check_tokens

__all__ = ["Step", "make_step", "window_for", "windows_for", "check_windows", "check_outputs", "output_bucket"]

#: ``apply(state, tokens, memory, inputs) -> (logits, memory)``: the model call a Step runs.
ApplyFn = Callable[[Any, Array, Memory, UbatchInputs], Tuple[Array, Memory]]


def _run(apply, contiguous, vocab_size, state, rest, buffers, ubatch, tokens, placement, outputs, *, windows):
    memory = rest.join(buffers)
    if placement is None:
        memory, placement, ok = memory.find_slot(ubatch, contiguous=contiguous)
    else:
        ok = jnp.bool_(True)
    # what the step cannot compute makes it fail instead of returning wrong logits with ok true,
    # and says why in the memory's error word (no room is not an error: ok false alone)
    bits = step_error_bits(memory, placement, windows, tokens, ubatch.valid, vocab_size)
    ok = ok & (bits == 0)
    # a failed step writes nothing (its placement is voided) and keeps the metadata from before it
    # (the seed's restore): no buffer a live sequence reads changes
    placement = memory.mask_placement(placement, ok)
    logits, memory = apply(
        state, tokens, memory, UbatchInputs(ubatch=ubatch, placement=placement, windows=windows, outputs=outputs)
    )
    new_buffers, new_rest = memory.split()
    kept = jax.tree.map(lambda before, after: jnp.where(ok, after, before), rest, new_rest)
    return logits, kept.join(new_buffers).flag_errors(bits), ok


def step_error_bits(memory: Memory, placement, windows, tokens, valid, vocab_size) -> jax.Array:
    """The :class:`kvjax.ErrorFlag` bits of what a step cannot compute (``u32[]``, 0 when none).

    ``SLOT``: a placed cell outside ``[-1, size)`` of its attention part (a hand-made ``slot=``);
    ``WINDOW``: a placed cell inside the part but not inside its window; ``TOKEN``: a valid row's
    token id outside ``[0, vocab_size)``.
    """
    bits = jnp.uint32(0)
    for p in range(memory.n_parts):
        slots = memory.part_slots(placement, p)
        outside = jnp.any((slots < -1) | (slots >= memory.part(p).config.size))
        bits |= jnp.where(outside, jnp.uint32(ErrorFlag.SLOT), 0)
        bits |= jnp.where(~outside & jnp.any(slots >= windows[p]), jnp.uint32(ErrorFlag.WINDOW), 0)
    if vocab_size is not None:
        bad_token = jnp.any(((tokens < 0) | (tokens >= vocab_size)) & valid)
        bits |= jnp.where(bad_token, jnp.uint32(ErrorFlag.TOKEN), 0)
    return bits.astype(jnp.uint32)


# One jitted function per (apply, contiguous, vocabulary), so that Steps of models with the same
# structure (equal NNX graphdefs, equal linen modules) share their compiled programs.
_jit_run = functools.lru_cache(maxsize=64)(
    lambda apply, contiguous, vocab_size: jax.jit(
        functools.partial(_run, apply, contiguous, vocab_size),
        static_argnames=("windows",),
        donate_argnames=("buffers",),
    )
)


def check_windows(memory: Memory, windows=None, n_kv=None) -> Tuple[int, ...]:
    """The static window of each attention part, from ``windows`` (a tuple) or ``n_kv`` (one part)."""
    if (windows is None) == (n_kv is None):
        raise ValueError(
            "pass exactly one of windows= (one static window per attention part) and n_kv= "
            "(the window of a memory with one attention part)"
        )
    if n_kv is not None:
        if memory.n_parts != 1:
            raise ValueError(
                f"n_kv={n_kv!r} names one window but the memory has {memory.n_parts} attention "
                f"parts: allowed windows= with one window per part"
            )
        windows = (n_kv,)
    if not isinstance(windows, (tuple, list)) or len(windows) != memory.n_parts:
        raise ValueError(
            f"windows={windows!r} is out of range: allowed a tuple of {memory.n_parts} static "
            f"windows, one per attention part"
        )
    out = []
    for p, n in enumerate(windows):
        cfg = memory.part(p).config
        out.append(check_window(n, cfg.padding, cfg.size))
    return tuple(out)


class Step:
    """A jitted model step over a kvjax memory (see the module docstring).

    Args:
        apply: ``apply(state, tokens, memory, inputs) -> (logits, memory)`` for a placed ubatch
            (``make_step`` builds it for NNX and linen models). Steps with equal (hashable)
            ``apply`` share their compiled programs.
        contiguous: placement policy passed to ``kvjax.find_slot``.
        vocab_size: when given, a valid ubatch row with a token id outside ``[0, vocab_size)``
            makes the step fail (``ok`` false, nothing kept) instead of embedding garbage;
            ``make_step`` takes it from ``model.config.vocab_size``.

    A step also fails when ``n_kv`` / ``windows`` does not cover the cells placement chose. A
    failed step returns the memory's metadata as it was before the step (its K/V writes landed in
    cells that are free again, which no token can see), with the reason or-ed into its error word
    (``kvjax.errors(memory)``): ``ErrorFlag.TOKEN`` (a token id outside the vocabulary),
    ``ErrorFlag.SLOT`` (a given cell outside ``[-1, size)``), ``ErrorFlag.WINDOW`` (a placed cell
    outside its window). A full memory is not an error: ``ok`` false and no bit. Host values of
    ``tokens`` and ``slot`` (numpy arrays, lists) are checked before the step runs and raise
    ``ValueError`` instead; device arrays are never read back (no sync per token).
    """

    def __init__(self, apply: ApplyFn, *, contiguous: bool = True, vocab_size: Optional[int] = None):
        if not callable(apply):
            raise ValueError(f"apply must be callable, got {type(apply).__name__}")
        self.vocab_size = None if vocab_size is None else check_count("vocab_size", vocab_size, 1)
        self.contiguous = check_flag("contiguous", contiguous)
        self._jitted = _jit_run(apply, self.contiguous, self.vocab_size)

    def __call__(
        self,
        state,
        memory: Memory,
        ubatch: Ubatch,
        tokens: Int[Array, " T"],
        *,
        n_kv: Optional[int] = None,
        windows: Optional[Tuple[int, ...]] = None,
        placement: Optional[Placement] = None,
        slot: Optional[Int[Array, " T"]] = None,
        outputs: Optional[Int[Array, " R"]] = None,
    ) -> Tuple[Float[Array, "T V"], Memory, Bool[Array, ""]]:
        """Place ``ubatch`` (unless a placement is given), run the model, return the new memory.

        Args:
            state: the model state (``nnx.state(model)`` for NNX, the variables for linen).
            memory: the memory; its buffers are donated (use the returned memory afterwards).
            ubatch: the tokens' positions and sequences (``kvjax.make_ubatch``).
            tokens: ``i32[T]`` token ids of the ubatch rows.
            n_kv: static window N of a memory with one attention part (:func:`window_for`).
            windows: static windows, one per attention part (instead of ``n_kv``).
            placement: where the caller already placed the ubatch (``kvjax.find_slot``).
            slot: the unified cache's name for ``placement`` (``i32[T]``).
            outputs: ``i32[R]`` the ubatch rows (in ``[0, T)``, repeats allowed) whose logits are
                wanted, in the order wanted (llama.cpp's output ids); ``None`` for every row. Only
                these rows go through the final norm and the output projection; every row still
                writes its K/V or state. ``R`` is static (one program per ``R``: pad it to a
                bucket, e.g. by repeating a row), the values are traced (new rows never
                recompile). Values of a numpy array or list are checked here; a device array's
                are not read (no sync) and out-of-range values are clipped.

        Returns:
            ``(logits f32[T, V], memory, ok)`` (``f32[R, V]``, row ``r`` the logits of ubatch row
            ``outputs[r]``, with ``outputs``); when ``ok`` is false (no room, a window too small,
            a token outside the vocabulary) the memory's cells are as before the step and the
            logits carry no meaning.

        Raises:
            ValueError: not a memory, windows outside the allowed ones, tokens / slot whose
                shape does not match the ubatch, host tokens outside the vocabulary, host slots
                outside ``[-1, size)`` or outside the window, or ``outputs`` that is not a 1-d integer array
                of rows in ``[0, T)``.
        """
        require_memory(memory)
        if not isinstance(ubatch, Ubatch):
            raise ValueError(f"ubatch must be a kvjax.Ubatch (see kvjax.make_ubatch), got {type(ubatch).__name__}")
        windows = check_windows(memory, windows, n_kv)
        t = ubatch.length
        tokens = _int_rows("tokens", tokens, t)
        if self.vocab_size is not None and _on_host(tokens):
            check_tokens(tokens, ubatch, self.vocab_size)
        if slot is not None:
            if placement is not None:
                raise ValueError("pass placement= or slot=, not both")
            placement = _int_rows("slot", slot, t)
        if placement is not None and _on_host(placement):
            for p in range(memory.n_parts):
                name, size = ("slot" if memory.n_parts == 1 else f"placement (part {p})"), memory.part(p).config.size
                rows = np.asarray(memory.part_slots(placement, p))
                _check_host_rows(name, rows, -1, size, f"cells in [-1, size={size}) (-1: not written)")
                _check_host_rows(
                    name,
                    rows,
                    -1,
                    windows[p],
                    f"cells inside the window {windows[p]} the step was given (pick it with kvjax.nn.window_for)",
                )
        if outputs is not None:
            outputs = check_outputs(outputs, t)
        buffers, rest = memory.split()
        return self._jitted(state, rest, buffers, ubatch, tokens, placement, outputs, windows=windows)


def check_outputs(outputs, t: int):
    """``outputs`` as a 1-d integer array of ubatch rows in ``[0, t)``, or ``ValueError``.

    Host values (numpy, lists) are checked; a device array is taken as it is (reading it back
    would cost a sync on the per-token path), its shape and dtype checked only.
    """
    if not isinstance(outputs, jax.Array):
        outputs = np.asarray(outputs)
        if outputs.size == 0:
            outputs = outputs.astype(np.int32)
    if outputs.ndim != 1 or not np.issubdtype(outputs.dtype, np.integer):
        raise ValueError(
            f"outputs has shape {tuple(outputs.shape)} and dtype {outputs.dtype}: allowed a 1-d "
            f"integer array of ubatch rows in [0, {t})"
        )
    if isinstance(outputs, np.ndarray):
        if outputs.size and (outputs.min() < 0 or outputs.max() >= t):
            bad = int(outputs.min()) if outputs.min() < 0 else int(outputs.max())
            raise ValueError(f"outputs contains row {bad}: allowed rows in [0, {t}) (T = ubatch.length)")
        outputs = outputs.astype(np.int32)
    return outputs


def output_bucket(n: int) -> int:
    """The static number of output rows for ``n`` wanted rows: 0, or the next power of two.

    Pad ``outputs`` to it (repeating a row) so a handful of programs serves every count.

    Example:
        >>> [output_bucket(n) for n in (0, 1, 3, 8, 9)]
        [0, 1, 4, 8, 16]
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"n={n} is out of range: allowed >= 0")
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def _on_host(tree) -> bool:
    """Whether every leaf is a host value (numpy): those are read eagerly, device arrays never
    (no sync on the per-token path: their errors come back as error bits)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and not any(isinstance(x, jax.Array) for x in leaves)


def _check_host_rows(name, rows, lo, hi, allowed):
    """Host values of ``rows`` in ``[lo, hi)``."""
    rows = np.asarray(rows)
    bad = rows[(rows < lo) | (rows >= hi)]
    if bad.size:
        raise ValueError(f"{name} contains {int(bad[0])}: allowed {allowed}")


def _int_rows(name, x, t):
    """``x`` as an integer ``[t]`` array (numpy or jax, as given), or ``ValueError``.

    Reads only ``shape`` and ``dtype`` (cheap on the per-token path; no device sync).
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    if tuple(x.shape) != (t,) or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}: allowed an integer [T] "
            f"array with T = ubatch.length = {t}"
        )
    return x


@functools.lru_cache(maxsize=64)
def _nnx_apply(graphdef):
    def apply(state, tokens, memory, inputs):
        return nnx.merge(graphdef, state)(tokens, memory, inputs)

    return apply


@functools.lru_cache(maxsize=64)
def _linen_apply(module):
    def apply(variables, tokens, memory, inputs):
        return module.apply(variables, tokens, memory, inputs)

    return apply


def make_step(model, *, contiguous: bool = True) -> Step:
    """A :class:`Step` for an NNX model, a linen module, or an ``apply`` function.

    Steps made for models of the same structure (the same NNX graph, equal linen modules) share
    their compiled programs, whatever the weights.

    Args:
        model: an ``nnx.Module`` called as ``model(tokens, memory, inputs)`` (pass
            ``nnx.state(model)`` as the step's state); a linen ``nn.Module`` with the same
            ``__call__`` (pass its variables); or an ``apply`` function (see :class:`Step`).
        contiguous: placement policy of ``kvjax.find_slot``.

    Example:
        >>> from flax import nnx
        >>> from kvjax.nn import Llama, LlamaConfig, LlamaLinen, make_step
        >>> cfg = LlamaConfig(n_layer=1)
        >>> a, b = Llama(cfg, rngs=nnx.Rngs(0)), Llama(cfg, rngs=nnx.Rngs(1))
        >>> make_step(a)._jitted is make_step(b)._jitted       # one set of programs for both
        True
        >>> type(make_step(LlamaLinen(cfg))).__name__
        'Step'
    """
    if isinstance(model, nnx.Module):
        apply = _nnx_apply(nnx.graphdef(model))
    elif isinstance(model, nn.Module):
        apply = _linen_apply(model)
    elif callable(model):
        apply = model
    else:
        raise ValueError(f"model must be an nnx.Module, a linen Module or a callable, got {type(model).__name__}")
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    return Step(apply, contiguous=contiguous, vocab_size=vocab_size)


def window_for(memory: Memory, n_tokens: int):
    """A static window that covers every cell after ``n_tokens`` more tokens are placed.

    With ``n_tokens = 0`` it is the bucket of the cells as they are (``kvjax.n_kv``). Otherwise
    placement (contiguous or scattered) starts at or after ``head`` and never passes
    ``max(cell_max, head) + n_tokens``, because every cell from ``cell_max`` on is free. Reads one
    small array from the device.

    Returns:
        An int for a memory with one attention part, else a tuple with one window per part.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=256, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> window_for(cache, 40)
        64
    """
    require_memory(memory)
    n = check_count("n_tokens", n_tokens, 0, INT32_MAX)
    # one small program and one transfer: this runs once per decode step
    needed = jax.device_get(_needed(memory, np.int32(n)))
    windows = tuple(_bucket(memory.part(p).config, int(x)) for p, x in enumerate(needed))
    return windows[0] if len(windows) == 1 else windows


@jax.jit
def _needed(memory, n):
    return memory.extent_after(n)


def _bucket(config, cells_needed: int) -> int:
    return int(kvjax.window_bucket(int(min(config.size, max(cells_needed, 1))), config.size, config.padding))


def windows_for(memory: Memory, placements: Sequence[Placement], *, extent=None) -> list:
    """The exact windows of each ubatch of a batch, from the placements of ``kvjax.prepare``.

    After ubatch ``i`` is placed, each attention part extends to the larger of its ``cell_max``
    and the largest cell of ubatches ``0..i`` in that part (cells are only added during a batch).
    A caller that read ``memory.extent()`` already (with the placements, in one transfer) passes
    it as ``extent``.

    Returns:
        One entry per ubatch: an int for a memory with one attention part, else a tuple with one
        window per part.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=256, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> ubs = [kvjax.make_ubatch(range(0, 40), [[0]] * 40), kvjax.make_ubatch(range(40, 80), [[0]] * 40)]
        >>> ok, slots = kvjax.prepare(cache, ubs)
        >>> windows_for(cache, slots)
        [64, 128]
    """
    require_memory(memory)
    extent = jax.device_get(memory.extent()) if extent is None else extent
    windows = memory.windows_for(jax.device_get(tuple(placements)), extent)
    return [w[0] if len(w) == 1 else w for w in windows]
