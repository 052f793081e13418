"""A picture of the scheduler's steps: which requests each step's batch fed, prompt or decode.

Example:
    >>> import matplotlib; matplotlib.use("Agg")
    >>> ax = plot_steps([[(0, 5, "prompt")], [(0, 1, "decode"), (1, 3, "prompt")]])
    >>> ax.get_xlabel()
    'step'
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["plot_steps"]


def plot_steps(
    steps: Sequence[List[Tuple[int, int, str]]],
    ax=None,
    *,
    labels: Optional[Dict[int, str]] = None,
    n_batch: Optional[int] = None,
    title: str = "what each step fed",
):
    """Stacked bars, one per step: each request's tokens in that step's batch (``Scheduler.last_batch``).

    Prompt chunks are drawn pale, decode tokens solid, one colour per request.

    Args:
        steps: ``scheduler.last_batch`` after each step.
        ax: a matplotlib axis (default: a new figure's).
        labels: a legend name per request id (default ``"request <id>"``).
        n_batch: draw the step budget as a dashed line.
        title: the axis title.

    Returns:
        The axis.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.2))
    rids = sorted({rid for batch in steps for rid, _, _ in batch})
    colours = {rid: plt.get_cmap("tab10")(i % 10) for i, rid in enumerate(rids)}
    for x, batch in enumerate(steps):
        bottom = 0
        for rid, n, kind in batch:
            ax.bar(
                x,
                n,
                bottom=bottom,
                color=colours[rid],
                alpha=0.4 if kind == "prompt" else 1.0,
                width=0.85,
                edgecolor="white",
                linewidth=0.5,
            )
            bottom += n
    if n_batch:
        ax.axhline(n_batch, color="grey", linestyle="--", linewidth=1)
    names = labels or {}
    handles = [Patch(color=colours[r], label=names.get(r, f"request {r}")) for r in rids]
    handles += [Patch(color="grey", alpha=0.4, label="prompt chunk"), Patch(color="grey", label="decode token")]
    ax.legend(handles=handles, fontsize=7, ncol=2, loc="upper right", frameon=False)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens in the batch")
    ax.set_title(title)
    return ax
