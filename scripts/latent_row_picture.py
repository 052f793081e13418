"""Draw docs/latent_row.png: one cell of a latent (MLA) cache against the decompressed K/V it replaces.

The byte widths come from the real configs (``kvjax.CacheConfig(mla=True)`` for DeepSeek V2-Lite's
attention: kv_lora_rank 512, a 64-wide RoPE key, 16 heads of qk_nope 128 + qk_rope 64 and v_head
128, float16), and the view of V and the K-shift's columns from the cache itself. Run from the
repository root::

    python scripts/latent_row_picture.py
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import kvjax  # noqa: E402

RANK, ROPE, HEADS, NOPE, V_HEAD = 512, 64, 16, 128, 128


def configs():
    shape = dict(size=256, n_seq_max=1, n_layer=1, k_dtype="float16", v_dtype="float16")
    latent = kvjax.CacheConfig(
        n_kv_heads=1, head_dim=RANK + ROPE, head_dim_v=RANK, mla=True, rope=kvjax.RopeConfig(n_rot=ROPE), **shape
    )
    plain = kvjax.CacheConfig(n_kv_heads=HEADS, head_dim=NOPE + ROPE, head_dim_v=V_HEAD, **shape)
    return latent, plain


def main(path="docs/latent_row.png"):
    latent, plain = configs()
    per_cell = {c: kvjax.total_size(c) // c.size for c in (latent, plain)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 3.8), gridspec_kw={"height_ratios": [1, 1.6]})
    # one latent cell's row, to scale: [latent | RoPE key], V a view of the latent
    start = latent.rope_start(0)
    top.add_patch(Rectangle((0, 0), start, 1, color="#4c72b0"))
    top.add_patch(Rectangle((start, 0), ROPE, 1, color="#dd8452"))
    top.text(start / 2, 0.5, f"latent c (kv_lora_rank {RANK}) = V, a view", ha="center", va="center", color="white")
    top.text(start + ROPE / 2, 0.5, f"RoPE key\n{ROPE}", ha="center", va="center", fontsize=8)
    top.annotate("", xy=(0, 1.25), xytext=(RANK, 1.25), arrowprops=dict(arrowstyle="<->"))
    top.text(RANK / 2, 1.45, "V = K[..., :head_dim_v]: no V storage", ha="center", fontsize=8)
    top.annotate("", xy=(start, -0.25), xytext=(start + ROPE, -0.25), arrowprops=dict(arrowstyle="<->"))
    top.text(start + ROPE / 2, -0.7, "the only columns a K-shift rotates", ha="center", fontsize=8)
    top.set_xlim(0, RANK + ROPE)
    top.set_ylim(-1, 1.8)
    top.axis("off")
    top.set_title(f"one cell of the latent cache: one K row, {per_cell[latent]:,} bytes a layer (float16)", fontsize=10)
    # to scale: the latent row above the decompressed cell it replaces
    scale = (RANK + ROPE) / per_cell[latent]
    bottom.add_patch(Rectangle((0, 1.3), RANK + ROPE, 0.6, color="#4c72b0"))
    bottom.text(RANK + ROPE + 40, 1.6, "the latent cell, to scale", va="center", fontsize=8)
    x = 0.0
    for h in range(HEADS):
        for width, color in ((NOPE + ROPE, "#55a868"), (V_HEAD, "#c44e52")):
            w = width * 2 * scale
            bottom.add_patch(Rectangle((x, 0), w, 1, facecolor=color, edgecolor="white", linewidth=0.3))
            x += w
    bottom.text(x / 2, 0.5, f"{HEADS} heads x (K {NOPE + ROPE} + V {V_HEAD})", ha="center", va="center", color="white")
    bottom.set_xlim(0, x)
    bottom.set_ylim(-0.2, 2.0)
    bottom.axis("off")
    bottom.set_title(
        f"the decompressed K/V of the same attention: {per_cell[plain]:,} bytes a layer, "
        f"{per_cell[plain] / per_cell[latent]:.1f}x the latent cell's bytes",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
