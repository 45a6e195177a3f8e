"""``python -m pagedkv demo --disaggregated``: prefill and decode in two Ray actors.

The prefill actor runs each prompt to its first token on its own cache and
exports the prompt's K/V as a :class:`~pagedkv.SequenceKV`, which it puts in
Ray's object store; the decode actor fetches it, imports it into its own
cache and decodes every request with continuous batching.  The driver (the
demo's process) only passes object references, so the K/V go from the
prefill actor's node to the decode actor's and never through the driver:
within one node through Ray's shared-memory store, whose numpy buffers the
decode actor reads without a copy; between nodes by Ray's object transfer.
Ray places the actors; pagedkv only moves the pages.  How to run them on two
machines, and what crosses the network: ``docs/transfer.md``.

Importing this module does not import Ray; :func:`serve` does.
"""
import argparse
import time
from dataclasses import dataclass, field
from typing import Dict, List

RAY_INSTALL = 'pip install "pagedkv[ray]"'


class _Worker:
    """A model and an engine over its own cache, in one actor's process."""

    def __init__(self, model_path, cache_args, num_pages, engine_options, blas_threads,
                 on_finish=None):
        from pagedkv.models.demo import make_cache
        from pagedkv.models.engine import Engine
        from pagedkv.models.gguf_loader import load_gguf_model, read_gguf_header
        if blas_threads:    # for the actor's life: its process does nothing else
            from threadpoolctl import threadpool_limits
            self._blas_limits = threadpool_limits(limits=int(blas_threads), user_api="blas")
        header = read_gguf_header(model_path)
        config = header.config
        self.cache = make_cache(config, num_pages, cache_args)
        self.engine = Engine(load_gguf_model(header).model, self.cache,
                             max_seq_len=config.max_position, on_finish=on_finish,
                             **engine_options)
        self.engine.warm_up()


class PrefillWorker(_Worker):
    """Runs prompts to their first token and hands each prompt's K/V over through
    Ray's object store."""

    def __init__(self, *args):
        self._exported = {}
        super().__init__(*args, on_finish=self._export)
        self.num_prompts = 0
        self.prefill_seconds = 0.0

    def _export(self, request):
        start = time.perf_counter()
        self._exported[request.request_id] = (self.cache.export_sequence(request.seq_id),
                                              time.perf_counter() - start)

    def prefill(self, prompt_ids, temperature):
        """Prefill one prompt.

        Returns
        -------
        first_token : int
        kv : list of one ray.ObjectRef
            The prompt's SequenceKV, put in the object store by this actor (in a
            list, so that Ray passes the reference on instead of the data).
        timing : dict
            ``export_seconds``, ``put_seconds`` and ``nbytes`` of the K/V.
        """
        import ray
        start = time.perf_counter()
        request_id = self.engine.add_request(prompt_ids, max_new_tokens=1,
                                             temperature=temperature)
        while self.engine.has_unfinished():
            self.engine.step()
        first_token = self.engine.requests.pop(request_id).output_ids[0]
        kv, export_seconds = self._exported.pop(request_id)
        self.num_prompts += 1
        self.prefill_seconds += time.perf_counter() - start - export_seconds
        start = time.perf_counter()
        ref = ray.put(kv)
        return first_token, [ref], dict(export_seconds=export_seconds, nbytes=kv.nbytes,
                                        put_seconds=time.perf_counter() - start)

    def report(self):
        from pagedkv.models.report import prefix_hit_rate
        return (f"prefill actor: {self.num_prompts} prompts, "
                f"{1e3 * self.prefill_seconds / max(1, self.num_prompts):.0f} ms each to "
                f"their first token; prefix cache hit rate {prefix_hit_rate(self.cache)}")


class DecodeWorker(_Worker):
    """Imports prefilled K/V and decodes every request, continuously batched."""

    def __init__(self, *args):
        super().__init__(*args)
        self._index_of = {}

    def add(self, index, prompt_ids, first_token, kv, max_new_tokens, temperature, stop_ids):
        """Queue prompt ``index``'s decode; ``kv`` is ``PrefillWorker.prefill``'s list of
        one reference, fetched here.  Returns the seconds the fetch took."""
        import ray
        start = time.perf_counter()
        sequence_kv = ray.get(kv[0])
        fetch_seconds = time.perf_counter() - start
        request_id = self.engine.add_prefilled_request(
            prompt_ids, sequence_kv, first_token, max_new_tokens=max_new_tokens,
            temperature=temperature, stop_ids=stop_ids)
        self._index_of[request_id] = index
        return fetch_seconds

    def step(self):
        """One engine step: ``[(index, token_id, finish_reason, import_seconds)]``."""
        events = self.engine.step()
        requests = self.engine.requests
        return [(self._index_of[e.request_id], e.token_id, e.finish_reason,
                 requests[e.request_id].import_seconds) for e in events]

    def report(self, **kwargs):
        """The engine's report lines (``format_report``'s keyword arguments)."""
        from pagedkv.models.report import format_report
        return format_report(self.engine.stats, self.cache, **kwargs)


@dataclass
class TransferStats:
    """What moving each request's K/V from the prefill actor to the decode actor cost.

    A transfer is the export (pages to numpy; off the device on opencl), the
    put into Ray's object store, the decode actor's fetch and the import into
    its pages.  A request's time runs from its prefill's submission to its
    last token, as the driver sees them.
    """
    nbytes: List[int] = field(default_factory=list)
    request_seconds: List[float] = field(default_factory=list)
    parts: Dict[str, List[float]] = field(default_factory=lambda: {
        "export": [], "put": [], "fetch": [], "import": []})

    def add(self, nbytes, request_seconds, **parts):
        self.nbytes.append(nbytes)
        self.request_seconds.append(request_seconds)
        for name, seconds in parts.items():
            self.parts[name].append(seconds)

    @property
    def transfer_seconds(self):
        """Per request, the sum of its parts."""
        return [sum(p) for p in zip(*self.parts.values())]

    def lines(self):
        if not self.nbytes:
            return ["K/V transfer: none (every request ended with its first token)"]
        n = len(self.nbytes)
        mean = {name: 1e3 * sum(values) / n for name, values in self.parts.items()}
        share = sum(self.transfer_seconds) / sum(self.request_seconds)
        return [f"K/V transfer, prefill actor -> decode actor: {n} requests of "
                f"{sum(self.nbytes) / n / 2**20:.2f} MiB on average, "
                f"{1e3 * sum(self.transfer_seconds) / n:.1f} ms each (export "
                f"{mean['export']:.1f}, object store put {mean['put']:.1f}, fetch "
                f"{mean['fetch']:.1f}, import {mean['import']:.1f}): {100 * share:.1f}% of "
                f"the requests' time"]


def _ray():
    try:
        import ray
    except ImportError:
        from pagedkv.models.errors import MissingDependencyError
        raise MissingDependencyError(f"--disaggregated needs Ray; install with: "
                                     f"{RAY_INSTALL}") from None
    return ray


def serve(args, model_path, prompt_ids, stop_ids, num_pages, on_token, *, max_seq_len,
          layer_windows=None):
    """Serve ``prompt_ids`` with prefill and decode in two Ray actors.

    Prompt ``i`` goes to the prefill actor before decode step ``i *
    args.stagger``.  Starts a local Ray cluster unless Ray is initialised
    already or ``args.ray_address`` names one (``"auto"``: the cluster this
    machine belongs to).

    Parameters
    ----------
    args : argparse.Namespace
        The demo's options.
    model_path : str
        The GGUF file, at this path on every node that runs an actor.
    prompt_ids : list of list of int
    stop_ids : collection of int
    num_pages : int
        Pages of each actor's cache.
    on_token : callable
        ``on_token(index, token_id)`` for every generated token, in order.
    max_seq_len : int
    layer_windows : list, optional
        The model's windows (for the report).

    Returns
    -------
    outputs : list of list of int
        Generated ids per prompt.
    report : list of str
    wall_seconds : float
    """
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=args.ray_address, log_to_driver=False)
    engine_options = dict(max_num_seqs=args.max_seqs,
                          max_num_batched_tokens=args.max_batch_tokens, seed=args.seed)

    def worker_args(prefix_caching):
        cache_args = argparse.Namespace(page_size=args.page_size, kv_dtype=args.kv_dtype,
                                        backend=args.backend, prefix_caching=prefix_caching,
                                        cascade=args.cascade)
        return model_path, cache_args, num_pages, engine_options, args.blas_threads

    # on two nodes when the cluster has them (SPREAD), else side by side; num_cpus=0:
    # they fit whatever the cluster's CPU count (each uses its BLAS and KV threads).
    # Prompts sharing a prefix reuse it in the prefill actor; the decode actor
    # only imports.
    options = dict(num_cpus=0, scheduling_strategy="SPREAD")
    prefill = ray.remote(PrefillWorker).options(**options).remote(
        *worker_args(args.prefix_caching))
    decode = ray.remote(DecodeWorker).options(**options).remote(*worker_args(False))
    try:
        outputs, stats, wall_seconds = _drive(ray, prefill, decode, args, prompt_ids,
                                              set(stop_ids), on_token, max_seq_len)
        report = ["disaggregated: prefill and decode in two Ray actors; the decode actor:"]
        report += ray.get(decode.report.remote(
            max_seq_len=max_seq_len, wall_seconds=wall_seconds, num_prompts=len(prompt_ids),
            num_generated=sum(map(len, outputs)), layer_windows=layer_windows))
        report.append(ray.get(prefill.report.remote()))
        return outputs, report + stats.lines(), wall_seconds
    finally:
        ray.kill(prefill)
        ray.kill(decode)


def _drive(ray, prefill, decode, args, prompt_ids, stop_ids, on_token, max_seq_len):
    """Hand prompts to the prefill actor as they arrive, their K/V on to the decode
    actor as they are ready, and run decode steps while any request decodes."""
    outputs = [[] for _ in prompt_ids]
    stats = TransferStats()
    arrivals = {}
    for index in range(len(prompt_ids)):
        arrivals.setdefault(index * args.stagger, []).append(index)
    prefilling = {}          # first-token ref -> (index, kv ref, timing ref)
    decoding = {}            # index -> (timing ref, fetch-seconds ref)
    submitted_at = {}
    step = 0
    start = time.perf_counter()

    def emit(index, token):
        outputs[index].append(token)
        on_token(index, token)

    while arrivals or prefilling or decoding:
        for index in arrivals.pop(step, []):
            token, kv, timing = prefill.prefill.options(num_returns=3).remote(
                prompt_ids[index], args.temperature)
            prefilling[token] = (index, kv, timing)
            submitted_at[index] = time.perf_counter()
        ready = []
        if prefilling:          # without decodes to run, wait for a prefill to finish
            ready, _ = ray.wait(list(prefilling), num_returns=1 if not decoding else
                                len(prefilling), timeout=None if not decoding else 0)
        for token_ref in ready:
            index, kv, timing = prefilling.pop(token_ref)
            token = ray.get(token_ref)
            emit(index, token)
            if token in stop_ids or args.max_new_tokens == 1 or \
                    len(prompt_ids[index]) + 1 >= max_seq_len:    # as the engine ends requests
                continue
            fetch = decode.add.remote(index, prompt_ids[index], token, kv,
                                      args.max_new_tokens, args.temperature, tuple(stop_ids))
            decoding[index] = (timing, fetch)
        if decoding:
            for index, token, finish_reason, import_seconds in ray.get(decode.step.remote()):
                emit(index, token)
                if finish_reason is None:
                    continue
                timing, fetch = (ray.get(ref) for ref in decoding.pop(index))
                stats.add(timing["nbytes"], time.perf_counter() - submitted_at[index],
                          export=timing["export_seconds"], put=timing["put_seconds"],
                          fetch=fetch, **{"import": import_seconds})
        step += 1
    return outputs, stats, time.perf_counter() - start
