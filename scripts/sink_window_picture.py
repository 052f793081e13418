"""Draw docs/sink_window.png: one sequence's cells over time under kvjax.SinkWindow.

Runs the real operations (``sink_window_evict`` then ``find_slot`` for each token, one token per
step) on a memory of 8 cells with ``SinkWindow(n_sink=2, n_recent=6)``, in both forms, and shows
which token each cell holds after each step (colour: the token's index in the text; number: the
cell's position). Run from the repository root::

    python scripts/sink_window_picture.py
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402

N_TOKENS = 20


def history(window: kvjax.SinkWindow):
    """``(token, pos)``, each ``i32[steps, cells]`` (-1 for a free cell): the cells after each step."""
    cfg = kvjax.CacheConfig(
        size=window.n_cells,
        n_seq_max=1,
        n_layer=1,
        n_kv_heads=1,
        head_dim=2,
        rope=kvjax.RopeConfig(n_rot=2),
        padding=window.n_cells,
    )
    memory, next_pos = kvjax.init(cfg), 0
    holder = np.full(window.n_cells, -1)  # which token of the text each cell holds
    tokens, positions = [], []
    for t in range(N_TOKENS):
        memory, next_pos = kvjax.sink_window_evict(memory, 0, next_pos, window)
        next_pos = int(next_pos)
        memory = kvjax.update(memory)  # the K-shift of the compacted form
        memory, slot, ok = kvjax.find_slot(memory, kvjax.make_ubatch([next_pos], [[0]]), contiguous=False)
        assert bool(ok)
        pos = kvjax.cell_table(memory).pos
        holder[pos < 0] = -1  # evicted cells hold nothing
        holder[int(slot[0])] = t
        next_pos += 1
        tokens.append(holder.copy())
        positions.append(pos.copy())
    return np.array(tokens), np.array(positions)


def draw(ax, window: kvjax.SinkWindow, title: str):
    tokens, positions = history(window)
    shown = np.ma.masked_less(tokens.T, 0)
    ax.imshow(shown, cmap="viridis", vmin=0, vmax=N_TOKENS - 1, aspect="auto")
    for step in range(tokens.shape[0]):
        for cell in range(tokens.shape[1]):
            if tokens[step, cell] >= 0:
                sink = tokens[step, cell] < window.n_sink
                ax.text(
                    step,
                    cell,
                    str(positions[step, cell]),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="red" if sink else "white",
                    fontweight="bold" if sink else "normal",
                )
    ax.set_xlabel("step (token of the text placed)")
    ax.set_ylabel("cell")
    ax.set_xticks(range(0, N_TOKENS, 2))
    ax.set_title(title, fontsize=10)


def main(path="docs/sink_window.png"):
    fig, axes = plt.subplots(1, 2, figsize=(13, 3.6))
    draw(axes[0], kvjax.SinkWindow(2, 6), "compact (default): positions 0..7 always,\nK re-rotated as tokens move back")
    draw(
        axes[1],
        kvjax.SinkWindow(2, 6, compact=False),
        "masked (llama.cpp's form): positions grow,\nthe evicted cell is only removed",
    )
    fig.suptitle(
        "SinkWindow(n_sink=2, n_recent=6) in 8 cells: colour = which token of the text, number = its "
        "position (sinks in red)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
