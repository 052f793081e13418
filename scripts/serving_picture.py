"""Draw docs/serving_steps.png: what each step of the scheduler fed, for requests that come and go.

The demo's character model serves four requests arriving at steps 0, 0, 3 and 8 with a budget of
24 tokens per step (``kvjax.serve.plot_steps`` of ``Scheduler.last_batch``). Run from the
repository root::

    python scripts/serving_picture.py
"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import kvjax  # noqa: E402
from kvjax.app._charlm import load  # noqa: E402
from kvjax.serve import Scheduler, ServeRequest, plot_steps  # noqa: E402

TEXTS = ["The file is ", "Return the value of the name ", "If the ", "The name of the file is "]
ARRIVE = {0: [0, 1], 3: [2], 8: [3]}


def main():
    model, tok, _ = load(verbose=False)
    engine = kvjax.Engine(model, kvjax.init(model.config.cache_config(size=256, n_seq_max=4, padding=32)), n_ubatch=32)
    scheduler = Scheduler(engine, n_batch=24, device_loop=False)
    owner, steps = {}, []
    for step in range(200):
        for i in ARRIVE.get(step, []):
            owner[scheduler.submit(ServeRequest(tok.encode(TEXTS[i]).tolist(), max_tokens=12))] = i
        scheduler.step()
        steps.append(scheduler.last_batch)
        if step > 8 and scheduler.idle:
            break
    ax = plot_steps(
        steps,
        labels={r: f"request {i}" for r, i in owner.items()},
        n_batch=24,
        title="each step: one token per decoding request, then prompt chunks up to n_batch=24",
    )
    ax.figure.tight_layout()
    ax.figure.savefig("docs/serving_steps.png", dpi=110)
    plt.close(ax.figure)
    print("wrote docs/serving_steps.png")


if __name__ == "__main__":
    main()
