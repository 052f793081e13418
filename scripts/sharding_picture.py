"""Draw docs/sharding.png: which device holds which part of a memory on a 2x4 mesh.

Run from the repository root (it starts JAX with 8 virtual CPU devices)::

    python scripts/sharding_picture.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import kvjax  # noqa: E402
from kvjax import shard  # noqa: E402
from kvjax.plot import plot_sharding  # noqa: E402


def main(path="docs/sharding.png"):
    mesh = shard.make_mesh(data=2, model=4)  # devices 0-3 in data row 0, 4-7 in data row 1
    base = kvjax.CacheConfig(size=32, n_seq_max=8, n_layer=2, n_kv_heads=8, head_dim=8, padding=8)
    unified = kvjax.init(base, mesh=mesh)
    streams = kvjax.init(kvjax.StreamsConfig(base), mesh=mesh)
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    plot_sharding(
        unified.k[0],
        dims=(1, 2),
        ax=axes[0],
        names=("kv head", "cell"),
        title="unified K [L, H, C, D]: heads on 'model',\nreplicated over 'data'",
    )
    plot_sharding(
        unified.cells.pos[None, :],
        dims=(0, 1),
        ax=axes[1],
        names=("", "cell"),
        title="unified cell metadata (pos, seq, head):\nwhole on every device",
    )
    plot_sharding(
        streams.cache.k[0],
        dims=(0, 2),
        ax=axes[2],
        names=("stream", "kv head"),
        title="streams K [S, L, H, C, D]: streams on 'data',\nheads on 'model'",
    )
    axes[1].set_yticks([])
    fig.suptitle("kvjax.init(config, mesh=make_mesh(data=2, model=4)) with the default rules")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
