"""One helper for the jit/donated twins: a function compiled twice, picked by a host flag.

Operations that move K/V (K-shift, defrag, state reads) can run in place when the caller gives up
the input's buffers (``donate=True``) or must leave the input valid (the default). Both programs
are built once, here, the same way everywhere.

Example:
    >>> import jax.numpy as jnp
    >>> double = JitTwins(lambda x: x * 2, donate_argnums=0)
    >>> double(jnp.arange(3), donate=False).tolist()
    [0, 2, 4]
"""

from __future__ import annotations

import jax

from kvjax._validate import check_flag, is_traced


class JitTwins:
    """``fn`` jitted plainly and with ``donate_argnums`` donated; ``__call__(..., donate=)`` picks one.

    Args:
        fn: the function.
        donate_argnums: the positional arguments whose buffers a donated call gives up.
        **jit_options: passed to both ``jax.jit`` calls (``static_argnums``, ``static_argnames``).
    """

    def __init__(self, fn, *, donate_argnums, **jit_options):
        self.plain = jax.jit(fn, **jit_options)
        self.donated = jax.jit(fn, donate_argnums=donate_argnums, **jit_options)

    def __call__(self, *args, donate: bool = False, **kwargs):
        return (self.donated if donate else self.plain)(*args, **kwargs)


def donating(donate, probe) -> bool:
    """Whether to run the donated twin: ``donate`` (a real bool) and ``probe`` is concrete.

    Inside an outer ``jit`` the values are traced and donation is that ``jit``'s business.
    """
    return check_flag("donate", donate) and not is_traced(probe)
