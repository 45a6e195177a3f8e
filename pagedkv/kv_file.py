"""``PagedKVCache.save`` / ``load``: sequences and the prefix cache in one safetensors file.

The file is written by the ``safetensors`` library (no format of our own,
and nothing in it is ever executed).  Its string metadata carry
``pagedkv_format_version``, the saving cache's configuration under the
constructor's argument names (each a JSON value), ``rotation_block`` (int8
rows' Hadamard block), ``sequences`` and ``prefix_cache`` (JSON: what the
tensors hold) and a ``checksum``, ``"crc32:<hex>"`` over every other
metadata entry and every tensor's name, dtype, shape and bytes (see
:func:`checksum`).

Tensors, with ``{l}`` a layer and rows ``[n, num_kv_heads, head_dim]`` (V rows
``v_head_dim`` wide) in the
storage dtype (scales ``[n, num_kv_heads]`` float32, int8 only; the latent
layout has no ``.v`` and ``.v_scales`` tensors: ``kv_layout`` and ``v_head_dim``
are in the configuration, and a file without them is of the separate layout):

* ``sequence.{i}.k.{l}``, ``.v.{l}``, ``.k_scales.{l}``, ``.v_scales.{l}``:
  sequence ``i``'s rows from its ``layer_start`` on (a
  :class:`~pagedkv.transfer.SequenceKV`), and ``sequence.{i}.token_ids``
  (int32) when it has them;
* ``prefix_cache.token_ids`` ``[N, page_size]`` int32, ``.parents`` ``[N]``
  int64 (an earlier page, or -1 for a prompt's first page) and
  ``.has_window`` ``[N]`` uint8: the cached pages, parents first;
  ``prefix_cache.k.{l}`` etc.: their rows, ``page_size`` per page, for
  every page in a full-attention layer and for the pages with
  ``has_window`` in a windowed one;
* hybrid models (``layer_states`` in the configuration: per layer None or
  its state arrays' shapes): ``sequence.{i}.state.{l}.{j}``, state array
  ``j`` of recurrent layer ``l`` after sequence ``i``'s last token (float32;
  a recurrent layer has no K/V rows), and the prefix snapshots:
  ``state_snapshots.digests`` ``[S, 32]`` uint8 (the token prefix's digest,
  :func:`pagedkv.state_pool.prefix_hasher`), ``.positions`` ``[S]`` int64 and
  ``state_snapshots.{l}.{j}`` ``[S, *shape]`` float32.  A file without
  ``layer_states`` has no recurrent layer.

``load`` reads and checks the whole file before it changes anything, then
reserves and writes the cached pages (re-cut to its own page size when
that differs), imports the sequences, and only then enters those pages in
the prefix cache: a failure anywhere leaves the cache as it was.
"""
import json
import os
import reprlib
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from pagedkv import transfer
from pagedkv._validate import check_int_vector
from pagedkv.backends.base import StoredRows, empty_rows
from pagedkv.errors import ArgumentTypeError, OutOfPagesError
from pagedkv.holdings import CacheHoldings
from pagedkv.storage import storage_format

FORMAT_VERSION = "1"
_CHECKSUM = "crc32"
_CONFIGURATION = ("num_layers", "num_kv_heads", "head_dim", "num_pages", "page_size", "dtype",
                  "max_seq_len", "enable_prefix_caching", "layer_windows", "num_window_pages",
                  "window_rollback_tokens", "kv_rotation", "kv_layout", "v_head_dim",
                  "layer_states")
#: What a file written before a configuration entry existed stands for.
_CONFIGURATION_BEFORE: Dict[str, Any] = {"kv_layout": "separate", "v_head_dim": None,
                                         "layer_states": None}


class _FileError(ValueError):
    """A problem of the file at ``path``: the message names both."""

    def __init__(self, path, problem):
        super().__init__(f"{path}: {problem}")


def _check_path(path):
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"path: expected a str or os.PathLike, got "
                                f"{type(path).__name__}")
    return os.fspath(path)


def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:
        raise ImportError('save and load need the safetensors library: '
                          'pip install "pagedkv[files]" (or pip install safetensors)') from None
    return safetensors


def _pages_for(num_tokens, page_size):
    return -(-num_tokens // page_size)


# -- what goes into a file ---------------------------------------------------------------
def _configuration(holdings: CacheHoldings) -> Dict[str, Any]:
    """The saving cache's configuration, under the constructor's argument names."""
    window_pool = holdings.window_pool
    return {"num_layers": holdings.num_layers, "num_kv_heads": holdings.num_kv_heads,
            "head_dim": holdings.head_dim, "num_pages": holdings.full_pool.allocator.num_pages,
            "page_size": holdings.page_size, "dtype": holdings.storage.name,
            "max_seq_len": holdings.max_seq_len, "enable_prefix_caching": holdings.prefix_caching,
            "layer_windows": list(holdings.layer_windows),
            "num_window_pages": window_pool.allocator.num_pages
            if window_pool is not None else None,
            "window_rollback_tokens": holdings.window_rollback_tokens,
            "kv_rotation": holdings.kv_rotation, "kv_layout": holdings.kv_layout,
            "v_head_dim": holdings.v_head_dim, "layer_states": _state_shapes(holdings)}


def _state_shapes(holdings: CacheHoldings) -> Optional[List[Any]]:
    """Per layer, None or its state arrays' shapes (lists); None without recurrent layers."""
    if holdings.states is None:
        return None
    return [None if shapes is None else [list(shape) for shape in shapes]
            for shapes in holdings.states.spec.shapes]


def _state_tensors(prefix, states):
    """``{prefix}.{l}.{j}`` for per-layer state arrays (None for attention layers)."""
    return {f"{prefix}.{layer}.{j}": array for layer, arrays in enumerate(states or ())
            for j, array in enumerate(arrays or ())}


def _export_snapshots(holdings: CacheHoldings) -> Dict[str, np.ndarray]:
    """The state pool's usable prefix snapshots as tensors (none: {})."""
    snapshots = holdings.states.snapshots() if holdings.states is not None else []
    if not snapshots:
        return {}
    slots = np.array([slot for _, _, slot in snapshots], np.int32)
    tensors: Dict[str, np.ndarray] = {"state_snapshots.digests": np.frombuffer(
                   b"".join(d for d, _, _ in snapshots), np.uint8).reshape(-1, 32).copy(),
               "state_snapshots.positions": np.array([p for _, p, _ in snapshots], np.int64)}
    for layer, shapes in enumerate(holdings.states.spec.shapes):   # type: ignore[union-attr]
        for j in range(len(shapes or ())):
            tensors[f"state_snapshots.{layer}.{j}"] = \
                holdings.states.store.read(layer, j, slots)         # type: ignore[union-attr]
    return tensors


def _row_tensors(prefix, rows_of_layers):
    """``{prefix}.k.{l}`` etc. for a list of per-layer StoredRows."""
    tensors = {}
    for layer, rows in enumerate(rows_of_layers):
        for name, array in zip(StoredRows._fields, rows):
            if array is not None:
                tensors[f"{prefix}.{name}.{layer}"] = array
    return tensors


def _export_chains(holdings: CacheHoldings) -> Tuple[Dict[str, np.ndarray], Dict[str, int]]:
    """The prefix cache's reachable pages: tensors and their count per pool."""
    chains = holdings.chains.export()
    pages = chains["pages"]             # [pools, N]: each pool's page of each place
    if not len(chains["parents"]):
        return {}, {"num_pages": 0, "num_window_pages": 0}
    ps = holdings.page_size
    window_pool = holdings.window_pool
    has_window = pages[window_pool.index] >= 0 if window_pool is not None else \
        np.zeros(pages.shape[1], bool)
    offsets = np.arange(ps, dtype=np.int64)
    slots = [(held[held >= 0][:, None].astype(np.int64) * ps + offsets).ravel()
             for held in pages]
    recurrent = holdings.recurrent_layers    # no K/V rows
    rows = [empty_rows(holdings.storage, 0, holdings.num_kv_heads, holdings.head_dim)
            if layer in recurrent else holdings.backend.read_rows(layer, slots[pool.index])
            for layer, pool in enumerate(holdings.layer_pool)]
    tensors = {"prefix_cache.token_ids": np.ascontiguousarray(chains["tokens"]),
               "prefix_cache.parents": chains["parents"],
               "prefix_cache.has_window": has_window.astype(np.uint8)}
    tensors.update(_row_tensors("prefix_cache", rows))
    return tensors, {"num_pages": pages.shape[1], "num_window_pages": int(has_window.sum())}


def checksum(metadata, tensors):
    """``"crc32:<hex>"``: the CRC-32 of a JSON text of the metadata (but ``checksum``)
    and of every tensor's name, dtype, shape and the CRC-32 of its bytes.

    The tensors' CRCs are computed on every core (zlib lets go of the GIL),
    as they cost as much as writing the file.
    """
    names = sorted(tensors)

    def crc(name):
        return zlib.crc32(np.ascontiguousarray(tensors[name]).reshape(-1).view(np.uint8).data)

    with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:
        crcs = list(pool.map(crc, names))
    text = json.dumps({"metadata": {k: v for k, v in metadata.items() if k != "checksum"},
                       "tensors": [[name, tensors[name].dtype.str, list(tensors[name].shape),
                                    value] for name, value in zip(names, crcs)]},
                      sort_keys=True)
    return f"{_CHECKSUM}:{zlib.crc32(text.encode()):08x}"


def save(holdings: CacheHoldings, path: Any, seq_ids: Optional[Sequence[int]] = None) -> None:
    """``cache.save``: see its docstring."""
    path = _check_path(path)
    st = _safetensors()
    if seq_ids is None:
        ids = holdings.tables.ids()
    else:
        ids = check_int_vector("seq_ids", seq_ids).tolist()
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids: expected distinct ids, got {ids}"[:200])
    for seq_id in ids:
        holdings.tables.seq_len(seq_id)     # unknown ids fail before anything is written
    kvs = [transfer.export_sequence(holdings, seq_id, copy=False) for seq_id in ids]
    tensors, sequences = {}, []
    for i, kv in enumerate(kvs):
        tensors.update(_row_tensors(f"sequence.{i}", [kv.rows(layer)
                                                      for layer in range(kv.num_layers)]))
        if kv.token_ids is not None:
            tensors[f"sequence.{i}.token_ids"] = kv.token_ids
        tensors.update(_state_tensors(f"sequence.{i}.state", kv.states))
        sequences.append({"num_tokens": kv.num_tokens, "layer_start": list(kv.layer_start),
                          "token_ids": kv.token_ids is not None})
    chains = {"num_pages": 0, "num_window_pages": 0}
    if holdings.prefix_caching:
        chain_tensors, chains = _export_chains(holdings)
        tensors.update(chain_tensors)
        tensors.update(_export_snapshots(holdings))
    metadata = {name: json.dumps(value) for name, value in _configuration(holdings).items()}
    metadata.update(pagedkv_format_version=FORMAT_VERSION,
                    rotation_block=json.dumps(holdings.storage.rotation_block),
                    sequences=json.dumps(sequences), prefix_cache=json.dumps(chains))
    metadata["checksum"] = checksum(metadata, tensors)
    _write_atomically(st, path, tensors, metadata)


def _write_atomically(st, path, tensors, metadata):
    """Write to a new file in ``path``'s folder, flush it to disk, rename it over
    ``path``; on any failure remove it and leave ``path`` as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    while True:
        temp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
        try:
            # created here, so that the umask sets its permissions as for any new file
            os.close(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:
            continue
    try:
        st.numpy.save_file(tensors, temp, metadata=metadata)
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException as exc:
        try:
            os.unlink(temp)
        except OSError:
            pass
        if isinstance(exc, st.SafetensorError):
            raise OSError(f"{path}: could not be written: {exc}") from exc
        raise
    try:   # the rename itself, to disk
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- reading a file ----------------------------------------------------------------------
def _json(path, metadata, key):
    if key not in metadata:
        raise _FileError(path, f"its metadata lack {key!r}")
    try:
        return json.loads(metadata[key])
    except (ValueError, RecursionError):       # (JSON nested past Python's stack)
        raise _FileError(path, f"its metadata entry {key!r} is not JSON (or nested too "
                               f"deeply): {metadata[key]!r}"[:200]) from None


def _shown(value):
    """A short text of a value read from a file, whatever its size or nesting."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxlist, shown.maxdict, shown.maxstring = 3, 8, 8, 60
    return shown.repr(value)


# The safetensors dtypes a pagedkv file holds.
# Every tag numpy has a dtype for, so that a storage format's element (whatever
# integer or float width it is) loads; _take then checks each tensor's dtype.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I8": np.int8,
           "I16": np.int16, "I32": np.int32, "I64": np.int64, "U8": np.uint8,
           "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_}


def _read(path):
    """The metadata and tensors of a pagedkv file, checksum verified.

    The safetensors library checks the file (its header, and that the
    tensors' byte ranges tile the data exactly); the data are then read in
    one call into one buffer, whose views at the header's offsets are the
    tensors.  (The library's ``get_tensor`` copies each tensor out of a
    memory map, with page faults on both sides: loading 189 MB took six
    times ``np.load``'s time.)
    """
    st = _safetensors()
    if not os.path.exists(path):
        raise _FileError(path, "no such file")
    if not os.path.isfile(path):
        raise _FileError(path, "not a file")
    try:
        with st.safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
    except st.SafetensorError as exc:
        raise _FileError(path, f"not a readable safetensors file: {exc} (truncated, "
                               f"corrupted or of another format)") from None
    except OSError as exc:
        raise _FileError(path, f"cannot be read: {exc}") from None
    if "pagedkv_format_version" not in metadata:
        raise _FileError(path, "not a pagedkv K/V file (a safetensors file without "
                               "pagedkv_format_version in its metadata)")
    if metadata["pagedkv_format_version"] != FORMAT_VERSION:
        raise _FileError(path, f"pagedkv_format_version {metadata['pagedkv_format_version']!r};"
                               f" this pagedkv reads version {FORMAT_VERSION!r}"[:200])
    tensors = _read_tensors(path)
    given = metadata.get("checksum", "")
    if not given.startswith(_CHECKSUM + ":"):
        raise _FileError(path, f"its metadata lack a {_CHECKSUM} checksum, got {given!r}"[:200])
    if checksum(metadata, tensors) != given:
        raise _FileError(path, "corrupted: its data do not match their checksum")
    return metadata, tensors


def _read_tensors(path):
    """Every tensor of a safetensors file that the library has checked, as views of
    one buffer (a file that changed since is refused)."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            data = np.empty(os.fstat(f.fileno()).st_size - 8 - size, np.uint8)
            got = f.readinto(data.data)
    except (OSError, ValueError, RecursionError) as exc:
        raise _FileError(path, f"cannot be read: {exc}") from None
    tensors = {}
    try:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise _FileError(path, f"the tensor {name!r} has dtype {entry['dtype']!r}, "
                                       f"which no pagedkv file holds")
            begin, end = entry["data_offsets"]
            if got != len(data) or not 0 <= begin <= end <= got or \
                    end - begin != int(np.prod(entry["shape"])) * np.dtype(dtype).itemsize:
                raise ValueError("the header does not match the data")
            tensors[name] = data[begin:end].view(dtype).reshape(entry["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, _FileError):
            raise
        raise _FileError(path, f"changed while it was read ({exc})") from None
    return tensors


class _Contents:
    """A checked file: its configuration, sequences and cached pages."""

    def __init__(self, path, metadata, tensors):
        self.path = path
        config = {key: _json(path, metadata, key)
                  if key in metadata or key not in _CONFIGURATION_BEFORE
                  else _CONFIGURATION_BEFORE[key] for key in _CONFIGURATION}
        if config["v_head_dim"] is None:
            config["v_head_dim"] = config["head_dim"]
        self.config = config
        for key in ("num_layers", "num_kv_heads", "head_dim", "page_size", "v_head_dim"):
            if isinstance(config[key], bool) or not isinstance(config[key], int) or \
                    config[key] < 1:
                raise _FileError(path, f"{key}: expected an int >= 1 in its metadata, got "
                                       f"{_shown(config[key])}")
        if config["kv_layout"] not in ("separate", "latent"):
            raise _FileError(path, f"kv_layout: expected 'separate' or 'latent' in its "
                                   f"metadata, got {_shown(config['kv_layout'])}")
        windows = config["layer_windows"]
        if not isinstance(windows, list) or len(windows) != config["num_layers"]:
            raise _FileError(path, f"layer_windows: expected a list of {config['num_layers']} "
                                   f"entries in its metadata")
        self.windowed = [w is not None for w in windows]
        self.state_shapes = self._state_shapes(config["layer_states"])
        rotation = _json(path, metadata, "rotation_block")
        self._tensors = dict(tensors)
        self.sequences = [self._sequence(i, entry, rotation)
                          for i, entry in enumerate(self._list(metadata, "sequences"))]
        self.chains = self._chains(_json(path, metadata, "prefix_cache"), rotation)
        self.snapshots = self._snapshots()
        if self._tensors:
            raise _FileError(path, f"unexpected tensors {sorted(self._tensors)[:5]}")

    def _state_shapes(self, layer_states):
        """Per layer, None or its state arrays' shapes (tuples); the file's
        ``layer_states`` checked (None: no recurrent layer)."""
        num_layers = self.config["num_layers"]
        if layer_states is None:
            return (None,) * num_layers

        def shape_ok(shape):
            return isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**31 for d in shape)
        if not isinstance(layer_states, list) or len(layer_states) != num_layers or not all(
                entry is None or isinstance(entry, list) and entry and all(map(shape_ok, entry))
                for entry in layer_states):
            raise _FileError(self.path, f"layer_states: expected a list of {num_layers} entries "
                                        f"(None or a list of shapes) in its metadata, got "
                                        f"{_shown(layer_states)}")
        return tuple(None if entry is None else tuple(tuple(shape) for shape in entry)
                     for entry in layer_states)

    def _states(self, prefix, count):
        """Per layer, None or its state arrays ``{prefix}.{l}.{j}``, each ``count``
        rows of the shape (``count`` None: one array of the shape)."""
        lead = () if count is None else (count,)
        return tuple(None if shapes is None else tuple(
            self._take(f"{prefix}.{layer}.{j}", np.float32, lead + shape)
            for j, shape in enumerate(shapes)) for layer, shapes in enumerate(self.state_shapes))

    def _snapshots(self):
        """The prefix snapshots: (digests [S, 32], positions [S], per-layer states)."""
        if "state_snapshots.positions" not in self._tensors:
            return None
        positions = self._tensors["state_snapshots.positions"]
        count = positions.shape[0] if positions.ndim == 1 else -1
        digests = self._take("state_snapshots.digests", np.uint8, (count, 32))
        positions = self._take("state_snapshots.positions", np.int64, (count,))
        return digests, positions, self._states("state_snapshots", count)

    def _list(self, metadata, key):
        value = _json(self.path, metadata, key)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise _FileError(self.path, f"{key}: expected a JSON list of objects")
        return value

    def _take(self, name, dtype, shape):
        """The tensor ``name``, checked to be ``dtype`` of ``shape``; taken out of the
        file's tensors (those left at the end are unexpected)."""
        if name not in self._tensors:
            raise _FileError(self.path, f"the tensor {name!r} is missing")
        array = self._tensors.pop(name)
        if array.dtype != dtype or array.shape != tuple(shape):
            raise _FileError(self.path, f"the tensor {name!r}: expected {np.dtype(dtype)} of "
                                        f"shape {list(shape)}, got {array.dtype} of shape "
                                        f"{list(array.shape)}")
        return array

    def _rows(self, prefix, counts, storage):
        """Per-layer StoredRows ``{prefix}.k.{layer}`` etc., ``counts[layer]`` rows each."""
        config = self.config
        out = []
        for layer, n in enumerate(counts):
            out.append(StoredRows(**{
                part.field: self._take(f"{prefix}.{part.field}.{layer}", part.dtype,
                                       (n, config["num_kv_heads"]) + part.row_shape)
                for part in storage.copy_set(config["head_dim"])}))
        return out

    def _storage(self, rotation):
        try:
            storage = storage_format(self.config["dtype"], self.config["head_dim"],
                                     bool(rotation), latent=self.config["kv_layout"] == "latent",
                                     v_head_dim=self.config["v_head_dim"])
        except ValueError as exc:
            raise _FileError(self.path, f"dtype: {exc}") from None
        if storage.rotation_block != rotation:
            raise _FileError(self.path, f"rotation_block {_shown(rotation)} does not match dtype "
                                        f"{storage.name} at head_dim {self.config['head_dim']} "
                                        f"and v_head_dim {self.config['v_head_dim']}")
        return storage

    def _sequence(self, i, entry, rotation):
        storage = self._storage(rotation)
        num_tokens, starts = entry.get("num_tokens"), entry.get("layer_start")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or \
                not 0 <= num_tokens < 2**31 or not isinstance(starts, list) or \
                len(starts) != self.config["num_layers"] or \
                not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= num_tokens
                        for s in starts):
            raise _FileError(self.path, f"sequences[{i}]: expected num_tokens (an int) and "
                                        f"layer_start ({self.config['num_layers']} ints in "
                                        f"[0, num_tokens]), got {_shown(entry)}")
        rows = self._rows(f"sequence.{i}", [num_tokens - s for s in starts], storage)
        tokens = self._take(f"sequence.{i}.token_ids", np.int32, (num_tokens,)) \
            if entry.get("token_ids") else None
        has_states = any(shapes is not None for shapes in self.state_shapes)
        states = self._states(f"sequence.{i}.state", None) if has_states else None
        kv = transfer.SequenceKV(
            num_tokens=num_tokens, num_kv_heads=self.config["num_kv_heads"],
            head_dim=self.config["head_dim"], dtype=storage.name,
            rotation_block=storage.rotation_block, layer_start=tuple(starts),
            **transfer.layer_arrays(storage, rows), token_ids=tokens,
            kv_layout=self.config["kv_layout"], v_head_dim=self.config["v_head_dim"],
            states=states)
        try:
            return kv.check(f"sequences[{i}]")
        except ValueError as exc:
            raise _FileError(self.path, str(exc)) from None

    def _chains(self, entry, rotation):
        if not isinstance(entry, dict):
            raise _FileError(self.path, "prefix_cache: expected a JSON object")
        n, n_window = entry.get("num_pages"), entry.get("num_window_pages")
        if not isinstance(n, int) or not isinstance(n_window, int) or \
                isinstance(n, bool) or isinstance(n_window, bool) or \
                not 0 <= n_window <= n:
            raise _FileError(self.path, f"prefix_cache: expected num_pages and "
                                        f"num_window_pages (ints, 0 <= num_window_pages <= "
                                        f"num_pages), got {_shown(entry)}")
        if n == 0:
            # earlier saves wrote an empty prefix cache as tensors of zero pages: such
            # files load too
            for name in [name for name in self._tensors if name.startswith("prefix_cache.")]:
                if self._tensors[name].ndim and not self._tensors[name].shape[0]:
                    del self._tensors[name]
            return None
        ps = self.config["page_size"]
        chains = transfer.CachedChains(
            page_size=ps, storage=self._storage(rotation),
            token_ids=self._take("prefix_cache.token_ids", np.int32, (n, ps)),
            parents=self._take("prefix_cache.parents", np.int64, (n,)),
            has_window=self._take("prefix_cache.has_window", np.uint8, (n,)).astype(bool),
            layer_windowed=tuple(self.windowed), rows=())
        if not np.all((chains.parents >= -1) & (chains.parents < np.arange(n))):
            raise _FileError(self.path, "prefix_cache.parents: expected each page's parent "
                                        "to be -1 or an earlier page")
        if int(chains.has_window.sum()) != n_window:
            raise _FileError(self.path, f"prefix_cache.has_window: expected {n_window} pages "
                                        f"with window K/V, got {int(chains.has_window.sum())}")
        rows = self._rows("prefix_cache", [0 if shapes is not None else
                                           (n_window if w else n) * ps
                                           for w, shapes in zip(self.windowed, self.state_shapes)],
                          chains.storage)
        return chains._replace(rows=tuple(rows))


def load(holdings: CacheHoldings, path: Any) -> List[int]:
    """``cache.load``: see its docstring."""
    path = _check_path(path)
    contents = _Contents(path, *_read(path))
    for key in ("num_layers", "num_kv_heads", "head_dim", "kv_layout", "v_head_dim"):
        if contents.config[key] != getattr(holdings, key):
            raise _FileError(path, f"{key}: the file's K/V have {key}={contents.config[key]}, "
                                   f"this cache {getattr(holdings, key)}")
    shapes = holdings.states.spec.shapes if holdings.states is not None \
        else (None,) * holdings.num_layers
    if contents.state_shapes != shapes:
        raise _FileError(path, f"layer_states: the file's layers keep states of shapes "
                               f"{_shown(contents.state_shapes)}, this cache's "
                               f"{_shown(shapes)}")
    if holdings.states is not None:
        needed = sum(1 for kv in contents.sequences if kv.num_tokens)
        if needed > holdings.states.num_free:
            raise OutOfPagesError(f"load: {path}: its sequences need {needed} slots of the "
                                  f"state pool, {holdings.states.num_free} of "
                                  f"{holdings.states.num_slots} free")
    starts = []
    for i, kv in enumerate(contents.sequences):
        try:
            transfer.check_fits(holdings, kv, f"sequences[{i}]")
            starts.append(transfer.window_start(holdings, kv))
        except ValueError as exc:
            raise _FileError(path, str(exc)) from None
    ps = holdings.page_size
    full, window = holdings.full_pool.allocator, holdings.window_pool
    window_allocator = window.allocator if window is not None else None
    pages = sum(_pages_for(kv.num_tokens, ps) for kv in contents.sequences)
    window_pages = sum(_pages_for(kv.num_tokens, ps) - start // ps
                       for kv, start in zip(contents.sequences, starts)) \
        if window_allocator is not None else 0
    if pages > full.num_free:
        raise OutOfPagesError(f"load: {path}: its sequences need {pages} pages, "
                              f"{full.num_free} of {full.num_pages} free")
    if window_allocator is not None and window_pages > window_allocator.num_free:
        raise OutOfPagesError(f"load: {path}: its sequences need {window_pages} window pages, "
                              f"{window_allocator.num_free} of "
                              f"{window_allocator.num_pages} free in the window pool")
    first_id = holdings.tables.next_id
    # all or nothing: the chains' pages are reserved and written first (the
    # sequences' pages are kept free for them) but join the prefix cache only
    # once every sequence is placed; on any failure the sequences placed so far
    # go, ids and all, and the chains' pages with them
    try:
        if contents.chains is not None and holdings.prefix_caching:
            transfer.reserve_cached_chains(holdings, contents.chains, pages, window_pages)
        ids = [transfer.import_sequence(holdings, kv, start)
               for kv, start in zip(contents.sequences, starts)]
    except BaseException:
        holdings.placement.undo_adopt(first_id)
        holdings.chains.undo()
        raise
    holdings.chains.commit()
    if contents.snapshots is not None and holdings.states is not None:
        digests, positions, states = contents.snapshots
        # after the sequences (which must fit); snapshots take the slots left
        for k in range(len(positions)):
            holdings.states.add_snapshot(
                digests[k].tobytes(), tuple(None if arrays is None else
                                            tuple(a[k] for a in arrays) for arrays in states),
                int(positions[k]))
    return ids
