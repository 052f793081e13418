"""``python -m kvjax serve --model PATH``: the OpenAI-compatible server on a checkpoint.

Loads the checkpoint as ``generate`` does (:func:`kvjax.app._generate.load`), builds one memory
of ``--ctx`` cells shared by ``--parallel`` sequences (the kind the model needs:
:func:`kvjax.nn.memory_config_for`), a :class:`kvjax.PromptCache` of it, the
:class:`kvjax.serve.Scheduler` and its worker thread, and serves ``kvjax/serve/_http.py``'s
routes with uvicorn. It listens on 127.0.0.1 unless ``--host`` says otherwise; ``--max-requests``
and ``--time-limit`` make it stop by itself (tests and load tests).
"""

from __future__ import annotations

import pathlib
import sys
import threading
import time
from typing import Optional

import kvjax
from kvjax import Engine
from kvjax.app._generate import CACHE_TYPES, DTYPES, chat_prompt, chat_stop_ids, load, resolve_chat_template
from kvjax.nn._pretrained import memory_config_for
from kvjax.serve._scheduler import Scheduler
from kvjax.serve._worker import Worker

try:  # the serve extra (starlette, sse-starlette, prometheus-client, uvicorn): only the server needs it
    import uvicorn

    from kvjax.serve._http import make_app

    MISSING = None
except ImportError as err:  # the other commands run without it
    uvicorn = make_app = None
    MISSING = err.name


def build(
    model_path,
    *,
    ctx: int = 4096,
    parallel: int = 4,
    n_ubatch: int = 64,
    n_batch: Optional[int] = None,
    cache_type: str = "float32",
    dtype: str = "float32",
    chat_template: Optional[str] = None,
    slot_dir: Optional[str] = None,
    model_name: Optional[str] = None,
    draft_path=None,
    n_draft: int = 4,
):
    """``(app, worker)``: the started worker and the Starlette app of a checkpoint (see the module docstring).

    With ``draft_path`` (a smaller checkpoint of the same vocabulary, llama-server's
    ``--model-draft``) greedy decode steps are speculative rounds of ``n_draft`` tokens
    (:class:`kvjax.serve.Scheduler`'s ``draft``); the prompt cache is off then (the draft's memory
    would need the same parked prefixes), and with it slot files.
    """
    if MISSING is not None:
        raise ValueError(f"the server needs the serve extra ({MISSING} is missing): pip install 'kvjax[serve]'")
    model, tok = load(model_path, dtype)
    kvjax.nn.fuse_projections(model)
    overrides = {} if cache_type == "float32" else dict(k_dtype=cache_type, v_dtype=cache_type)
    config = memory_config_for(model, size=ctx, n_seq_max=parallel, **overrides)
    memory = kvjax.init(config)
    engine = Engine(model, memory, n_ubatch=n_ubatch)
    limit = memory.context_per_sequence(1)
    draft = None
    if draft_path is not None:
        if slot_dir is not None:
            raise ValueError("--slot-save-path is out of range with --model-draft: slot files need the prompt cache")
        draft_model, _ = load(draft_path, dtype)
        kvjax.nn.fuse_projections(draft_model)
        draft_config = memory_config_for(draft_model, size=ctx, n_seq_max=parallel, **overrides)
        draft = Engine(draft_model, kvjax.init(draft_config), n_ubatch=n_ubatch)
    prompt_cache = (
        None if draft is not None else kvjax.PromptCache(memory.n_seq_max, limit if limit is not None else ctx)
    )
    scheduler = Scheduler(
        engine, n_batch=n_batch, prompt_cache=prompt_cache, tokenizer=tok, draft=draft, n_draft=n_draft
    )
    vocab = model.config.vocab_size
    try:
        template = resolve_chat_template(tok, chat_template)
    except ValueError:
        template = None  # no template: chat requests are refused with the reason

    def render(messages):
        if template is None:
            raise ValueError("this model has no chat template: start the server with --chat-template NAME|FILE")
        return chat_prompt(tok, messages, template)[1]

    folder = None
    if slot_dir is not None:
        folder = pathlib.Path(slot_dir)
        folder.mkdir(parents=True, exist_ok=True)
    worker = Worker(scheduler).start()
    app = make_app(
        worker,
        model_name=model_name or pathlib.Path(model_path).name,
        tokenizer=tok,
        render_chat=render,
        stop_tokens=[i for i in tok.eos_ids if i < vocab],
        chat_stop_tokens=[i for i in chat_stop_ids(tok, chat_template) if i < vocab],
        slot_dir=folder,
    )
    return app, worker


def run_server(app, worker, host: str, port: int, max_requests: int = 0, time_limit: float = 0.0, log_level="info"):
    """Serve until interrupted, or until ``max_requests`` finished or ``time_limit`` seconds passed."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off"))
    t0 = time.monotonic()

    def watch():
        while not server.should_exit:
            done = sum(v for k, v in worker.scheduler.stats.items() if k.startswith("finished_"))
            if (max_requests and done >= max_requests) or (time_limit and time.monotonic() - t0 > time_limit):
                server.should_exit = True
            time.sleep(0.1)

    if max_requests or time_limit:
        threading.Thread(target=watch, daemon=True).start()
    try:
        server.run()
    finally:
        worker.stop()


def main(args) -> int:
    try:
        app, worker = build(
            args.model,
            ctx=args.ctx,
            parallel=args.parallel,
            n_ubatch=args.ubatch,
            n_batch=args.batch,
            cache_type=args.cache_type,
            dtype=args.dtype,
            chat_template=args.chat_template,
            slot_dir=args.slot_save_path,
            model_name=args.alias,
            draft_path=args.model_draft,
            n_draft=args.draft_max,
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"kvjax serve: http://{args.host}:{args.port}/v1 ({args.parallel} sequences, {args.ctx} cells)", file=sys.stderr
    )
    run_server(app, worker, args.host, args.port, args.max_requests, args.time_limit)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible server with continuous batching (kvjax[serve])")
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint folder or a .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--alias", default=None, help="the model id clients use (default the file name)")
    p.add_argument("--ctx", type=int, default=4096, help="memory cells shared by all requests (default 4096)")
    p.add_argument("--parallel", type=int, default=4, help="requests running at once (sequence ids, default 4)")
    p.add_argument("--ubatch", type=int, default=64, help="most tokens per ubatch (default 64)")
    p.add_argument("--batch", type=int, default=None, help="most tokens per step (default --ubatch)")
    p.add_argument("--cache-type", default="float32", choices=CACHE_TYPES, help="K/V storage type (default float32)")
    p.add_argument("--dtype", default="float32", choices=DTYPES + ("file",), help="weight dtype (default float32)")
    p.add_argument("--chat-template", default=None, help="a built-in template name or a Jinja file")
    p.add_argument("--slot-save-path", default=None, help="folder for slot save/restore files (default: off)")
    p.add_argument(
        "--model-draft",
        default=None,
        help="a smaller checkpoint of the same vocabulary: speculative decoding of greedy requests (no prompt cache)",
    )
    p.add_argument("--draft-max", type=int, default=4, help="tokens the draft proposes per round (default 4)")
    p.add_argument("--max-requests", type=int, default=0, help="stop after this many finished requests (0: never)")
    p.add_argument("--time-limit", type=float, default=0.0, help="stop after this many seconds (0: never)")
