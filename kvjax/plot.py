"""Pictures of a cache (matplotlib, an optional dependency: ``pip install kvjax[plot]``).

- :func:`plot_cells`: the cell table as an image, one column per cell, one row per sequence
  (filled where the sequence holds the cell), with each cell's position written underneath
  when the cache is small enough to read.
- :func:`plot_mask`: a KQ mask (additive or boolean) as an image, tokens down, cells across.
- :func:`plot_sharding`: which devices hold which part of one array (two of its dimensions
  drawn, e.g. a K buffer's kv heads against its cells), for a memory placed on a mesh.

Example:
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import kvjax
    >>> from kvjax.plot import plot_cells
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4))
    >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch([0, 1, 2], [[0], [0, 1], [1]]))
    >>> ax = plot_cells(cache)
    >>> ax.get_title()
    'cells 3/32 used, head 0'
"""

from __future__ import annotations

import numpy as np

from kvjax.memory._unified import KVCache
from kvjax._inspect import cell_table


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("kvjax.plot needs matplotlib: pip install 'kvjax[plot]'") from err
    return plt


def plot_cells(cache: KVCache, ax=None, *, n_cells=None, show_pos=None):
    """Draw sequence membership of each cell (rows: sequences, columns: cells).

    Args:
        cache: the cache.
        ax: a matplotlib axes (default: a new figure).
        n_cells: draw only the first ``n_cells`` cells (default: all).
        show_pos: write each cell's position (default: when at most 64 cells are drawn).

    Returns:
        The axes.
    """
    plt = _pyplot()
    table = cell_table(cache)
    n = table.pos.shape[0] if n_cells is None else int(n_cells)
    seqs = table.seqs[:n].T.astype(float)  # [S, n]
    shared = table.seqs[:n].sum(axis=1) > 1
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16, 2 + n * 0.18), 1 + 0.35 * seqs.shape[0]))
    image = np.where(seqs > 0, np.where(shared[None, :], 2.0, 1.0), 0.0)
    ax.imshow(image, aspect="auto", cmap="Blues", vmin=0, vmax=2.2, interpolation="nearest")
    ax.set_yticks(range(seqs.shape[0]))
    ax.set_yticklabels([f"seq {s}" for s in range(seqs.shape[0])])
    ax.set_xlabel("cell (dark: shared by several sequences)")
    used = int(table.seqs.any(axis=1).sum())
    ax.set_title(f"cells {used}/{table.pos.shape[0]} used, head {table.head}")
    if show_pos if show_pos is not None else n <= 64:
        for i in range(n):
            if table.pos[i] >= 0:
                ax.text(i, seqs.shape[0] - 0.45, str(table.pos[i]), ha="center", va="top", fontsize=7)
    return ax


def plot_mask(mask, ax=None, *, title="KQ mask (white: visible)"):
    """Draw a ``[T, N]`` mask: additive (0 / finite visible, -inf masked) or boolean (True visible).

    Returns:
        The axes.
    """
    plt = _pyplot()
    m = np.asarray(mask)
    visible = m if m.dtype == bool else np.isfinite(m)
    if ax is None:
        _, ax = plt.subplots(figsize=(min(16, 2 + m.shape[1] * 0.15), 1 + m.shape[0] * 0.2))
    ax.imshow(~visible, aspect="auto", cmap="Greys", vmin=0, vmax=1.4, interpolation="nearest")
    ax.set_xlabel("cell")
    ax.set_ylabel("ubatch token")
    ax.set_title(title)
    return ax


def plot_sharding(x, dims=(0, 1), ax=None, *, names=None, title=None):
    """Draw which devices hold each block of two dimensions of ``x`` (a placed ``jax.Array``).

    Every index of the two drawn dimensions gets the set of devices whose shard holds it (from
    ``x.sharding.devices_indices_map``); the other dimensions are ignored (a shard of them is
    drawn where any device holds part of it). Blocks held by the same devices share a colour and
    are labelled with the device ids: a replicated dimension shows one label listing every
    device, a split one a label per piece.

    Args:
        x: the array (e.g. ``memory.k[0]``, ``[L, H, C, D]``).
        dims: the two dimensions drawn, rows first.
        ax: a matplotlib axes (default: a new figure).
        names: labels of the two dimensions (default ``"dim i"``).
        title: the axes title (default: the sharding's ``PartitionSpec``).

    Returns:
        The axes.

    Example:
        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import jax.numpy as jnp
        >>> from kvjax.plot import plot_sharding
        >>> ax = plot_sharding(jnp.zeros((2, 8, 16, 4)), dims=(1, 2), names=("kv head", "cell"))
        >>> ax.get_ylabel(), ax.get_xlabel()
        ('kv head', 'cell')
    """
    plt = _pyplot()
    a, b = (int(d) for d in dims)
    shape = tuple(x.shape)
    # the shards tile the two drawn dimensions in rectangles: each is a (rows, cols) pair of
    # slices, held by every device whose shard has it (several when replicated or split elsewhere)
    pieces = {}
    for device, index in x.sharding.devices_indices_map(shape).items():
        rows, cols = range(shape[a])[index[a]], range(shape[b])[index[b]]
        pieces.setdefault((rows.start, rows.stop, cols.start, cols.stop), set()).add(device.id)
    labels = sorted({tuple(sorted(devs)) for devs in pieces.values()})
    colour = {lab: k for k, lab in enumerate(labels)}
    image = np.zeros((shape[a], shape[b]))
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3))
    for (r0, r1, c0, c1), devs in pieces.items():
        lab = tuple(sorted(devs))
        image[r0:r1, c0:c1] = colour[lab]
        text = (
            f"device{'s' if len(lab) > 1 else ''} " + ",".join(map(str, lab))
            if len(lab) <= 4
            else f"{len(lab)} devices"
        )
        ax.text((c0 + c1 - 1) / 2, (r0 + r1 - 1) / 2, text, ha="center", va="center", fontsize=7)
    many = len(labels) > 10
    ax.imshow(
        image, aspect="auto", cmap="tab20" if many else "tab10", vmin=0, vmax=19 if many else 9, interpolation="nearest"
    )
    ax.set_ylabel(names[0] if names else f"dim {a}")
    ax.set_xlabel(names[1] if names else f"dim {b}")
    ax.set_title(title if title is not None else str(getattr(x.sharding, "spec", x.sharding)))
    return ax
