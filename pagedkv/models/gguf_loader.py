"""Read a Llama-family or Gemma 3 GGUF file: config from its metadata, float32 weights.

Quantized tensors (Q4_1, Q4_K, Q5_0, Q6_K, Q8_0, ...) are dequantized once,
at load, with ``gguf.quants.dequantize``; the engine then runs float32
matmuls.  The Q/K weights are used exactly as the file stores them: llama.cpp's
converter permutes Llama's for adjacent-pair RoPE and leaves Gemma's as they
are (NEOX halves), which is what :class:`~pagedkv.models.llama.LlamaModel`
and :class:`~pagedkv.models.gemma.GemmaModel` rotate.

:func:`read_gguf_header` reads the metadata and config only (cheap: the
tensors are memory-mapped); :func:`load_gguf_model` dequantizes the weights.
"""
import os
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import numpy as np

from pagedkv.models.errors import DEMO_INSTALL, MissingDependencyError, ModelFormatError
from pagedkv.models.gemma import (GEMMA3_FULL_EVERY, GemmaConfig, GemmaLayerWeights, GemmaModel,
                                  gemma3_layer_windows)
from pagedkv.models.gguf_file import GGUFFile, GGUFFormatError, read_gguf_file
from pagedkv.models.llama import LayerWeights, LlamaConfig, LlamaModel, LlamaWeights



@dataclass(frozen=True)
class _Architecture:
    """How one ``general.architecture``'s tensors map onto a model.

    ``layer_tensors`` maps each per-layer GGUF tensor (``blk.N.<name>.weight``)
    to its keyword of ``layer_class.from_projections``.
    """
    description: str
    layer_tensors: Dict[str, str]
    layer_class: type
    model_class: type
    optional_tensors: Tuple[str, ...]
    required_tensors: Tuple[str, ...] = ("token_embd", "output_norm")


_LLAMA_LAYER_TENSORS = {"attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk",
                        "attn_v": "wv", "attn_output": "wo", "ffn_norm": "ffn_norm",
                        "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}

#: ``general.architecture`` -> its tensor layout.  The keys are the architectures
#: this engine runs.
ARCHITECTURES = {
    "llama": _Architecture("Llama-family", _LLAMA_LAYER_TENSORS, LayerWeights, LlamaModel,
                           ("output", "rope_freqs")),
    "gemma3": _Architecture("Gemma 3", {**_LLAMA_LAYER_TENSORS,
                                        "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
                                        "post_attention_norm": "post_attention_norm",
                                        "post_ffw_norm": "post_ffw_norm"},
                            GemmaLayerWeights, GemmaModel, ("output",)),
}
#: ``general.architecture`` values whose tensors follow the Llama layout.
LLAMA_ARCHITECTURES = ("llama",)


def _import_gguf():
    try:
        import gguf
    except ImportError as exc:
        raise MissingDependencyError(
            f"reading GGUF models needs the gguf package: {DEMO_INSTALL}") from exc
    return gguf


@dataclass
class GGUFModel:
    """A loaded model file.

    Attributes
    ----------
    path : str
    model : LlamaModel or GemmaModel
        Config and float32 weights.
    metadata : dict
        Every GGUF key-value field (``general.*``, ``llama.*``, ``tokenizer.*``),
        as plain Python values; the tokenizer is built from it.
    """
    path: str
    model: LlamaModel
    metadata: Dict[str, Any]

    @property
    def name(self):
        """The model's ``general.name``, else the file name."""
        return model_name(self.metadata, self.path)


def model_name(metadata, path):
    """A GGUF's ``general.name``, else its file name."""
    return metadata.get("general.name") or os.path.basename(path)


def read_metadata(reader):
    """The key-value fields of an open GGUF as a dict of Python values.

    Parameters
    ----------
    reader : GGUFFile or gguf.GGUFReader
        From :func:`open_gguf`, or the ``gguf`` package's reader.
    """
    if isinstance(reader, GGUFFile):
        return dict(reader.metadata)
    return {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}             # header bookkeeping, not model metadata


def open_gguf(path):
    """Read a GGUF's metadata and tensor index (the tensors stay memory-mapped, not dequantized).

    Returns
    -------
    GGUFFile
        See :mod:`pagedkv.models.gguf_file` (much faster than
        ``gguf.GGUFReader`` on large vocabularies).

    Raises
    ------
    FileNotFoundError
        No such file.
    IsADirectoryError
        ``path`` is a directory (the message lists the GGUF files in it).
    ModelFormatError
        The file is not a readable GGUF.
    MissingDependencyError
        The ``gguf`` package is not installed.
    """
    _import_gguf()
    path = os.fspath(path)
    if os.path.isdir(path):
        found = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        hint = (f"; it holds {', '.join(found[:5])}{' ...' if len(found) > 5 else ''}"
                if found else "; it holds no .gguf file")
        raise IsADirectoryError(f"model: {path!r} is a directory, expected a GGUF file{hint}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: no such file: {path!r}")
    try:
        return read_gguf_file(path)
    except GGUFFormatError as exc:
        raise ModelFormatError(f"model: {path!r} is not a readable GGUF file ({exc})") from exc


def _architecture(metadata):
    """The :data:`ARCHITECTURES` entry of a GGUF's ``general.architecture``."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        kinds = " or ".join(a.description for a in ARCHITECTURES.values())
        raise ModelFormatError(f"model: expected a {kinds} GGUF (general.architecture in "
                               f"{list(ARCHITECTURES)}), got {arch!r}")
    return arch, ARCHITECTURES[arch]


def _sliding_windows(metadata, arch, num_layers):
    """Gemma 3's per-layer windows from ``{arch}.attention.sliding_window`` (and its pattern).

    The pattern is llama.cpp's: an int ``N`` (every ``N``-th layer full, 6 when
    absent, as llama.cpp hard-codes for gemma3) or one bool per layer (true =
    sliding).
    """
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is None or int(window) < 1:
        raise ModelFormatError(f"model: the GGUF lacks a positive '{arch}.attention."
                               f"sliding_window' (got {window!r})")
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", GEMMA3_FULL_EVERY)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise ModelFormatError(f"model: '{arch}.attention.sliding_window_pattern' has "
                                   f"{len(pattern)} entries for {num_layers} layers")
        return tuple(int(window) if sliding else None for sliding in pattern)
    if int(pattern) < 1:
        raise ModelFormatError(f"model: '{arch}.attention.sliding_window_pattern' must be "
                               f">= 1, got {pattern!r}")
    return gemma3_layer_windows(num_layers, int(window), int(pattern))


def config_from_metadata(metadata, *, num_tokens=None):
    """The model config from GGUF metadata: a :class:`LlamaConfig` or a :class:`GemmaConfig`.

    Parameters
    ----------
    metadata : dict
        From :func:`read_metadata`.
    num_tokens : int, optional
        Rows of ``token_embd`` (used when ``{arch}.vocab_size`` is absent).

    Raises
    ------
    ModelFormatError
        Not an architecture of :data:`ARCHITECTURES`, or a required key is missing.
    """
    arch, _ = _architecture(metadata)

    def get(key, default=None, required=False):
        value = metadata.get(f"{arch}.{key}", default)
        if required and value is None:
            raise ModelFormatError(f"model: the GGUF lacks the required key '{arch}.{key}'")
        return value

    num_heads = int(get("attention.head_count", required=True))
    num_kv_heads = get("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, (list, tuple)):
        if len(set(num_kv_heads)) != 1:
            raise ModelFormatError(f"model: per-layer KV head counts {sorted(set(num_kv_heads))} "
                                   f"are not supported")
        num_kv_heads = num_kv_heads[0]
    hidden = int(get("embedding_length", required=True))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelFormatError("model: key and value head sizes differ; not supported")
    vocab_size = get("vocab_size")
    if vocab_size is None:
        vocab_size = num_tokens if num_tokens is not None else \
            len(metadata.get("tokenizer.ggml.tokens", ()))
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelFormatError(f"model: RoPE scaling {scaling!r} is not supported "
                               f"(only none and linear)")
    num_layers = int(get("block_count", required=True))
    shape = dict(
        vocab_size=int(vocab_size), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_layers=num_layers, num_heads=num_heads, num_kv_heads=int(num_kv_heads),
        head_dim=head_dim, rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_dim=int(get("rope.dimension_count", head_dim)),
        max_position=int(get("context_length", 2048)))
    try:
        if arch == "gemma3":
            linear = float(get("rope.scaling.factor") or 1.0) if scaling == "linear" else 1.0
            return GemmaConfig(
                **shape, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
                layer_windows=_sliding_windows(metadata, arch, num_layers),
                rope_scale_full=linear)
        return LlamaConfig(**shape,
                           rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)))
    except ValueError as exc:
        raise ModelFormatError(f"model: inconsistent {ARCHITECTURES[arch].description} "
                               f"metadata: {exc}") from exc


def _check_tensor_names(names, num_layers, architecture):
    """Refuse tensors this forward pass would silently ignore (biases, experts, ...)."""
    a = architecture
    known = {f"{n}.weight" for n in a.required_tensors + a.optional_tensors}
    known |= {f"blk.{i}.{n}.weight" for i in range(num_layers) for n in a.layer_tensors}
    unknown = sorted(set(names) - known)
    if unknown:
        hint = " (mixture-of-experts)" if any("_exps" in n for n in unknown) else ""
        raise ModelFormatError(f"model: tensors this {a.description} engine does not "
                               f"support{hint}: {unknown[:6]}{' ...' if len(unknown) > 6 else ''}")
    optional = {f"{n}.weight" for n in a.optional_tensors}
    missing = sorted(n for n in known - set(names) if n not in optional)
    if missing:
        raise ModelFormatError(f"model: missing tensors {missing[:6]}"
                               f"{' ...' if len(missing) > 6 else ''}")


def _dequantize(tensor):
    """A tensor as float32 numpy in row-major order: ``[rows, cols]`` = GGUF ``ne`` reversed."""
    gguf = _import_gguf()
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelFormatError(f"model: tensor {tensor.name!r} is {tensor.tensor_type.name}, "
                               f"which gguf cannot dequantize ({exc})") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    # float32 tensors come back as views of the read-only file map: copy those
    return values if values.flags.writeable else values.copy()


@dataclass
class GGUFHeader:
    """A model file opened but not loaded: metadata and config, tensors still on disk.

    Reading it costs little (the tensors are memory-mapped), so a caller can
    check its arguments against the config and build the tokenizer before
    paying for :func:`load_gguf_model`.

    Attributes
    ----------
    path : str
    metadata : dict
        Every GGUF key-value field, as plain Python values.
    config : LlamaConfig or GemmaConfig
    file : GGUFFile
        The tensor index (data memory-mapped, not yet dequantized).
    """
    path: str
    metadata: Dict[str, Any]
    config: LlamaConfig
    file: GGUFFile

    @property
    def name(self):
        """The model's ``general.name``, else the file name."""
        return model_name(self.metadata, self.path)


def read_gguf_header(path):
    """Open a GGUF and read its metadata and config; check its tensor names.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    GGUFHeader

    Raises
    ------
    FileNotFoundError, IsADirectoryError, ModelFormatError
        As :func:`open_gguf` and :func:`config_from_metadata`; also for
        missing or unexpected tensors.
    MissingDependencyError
        The ``gguf`` package is not installed.
    """
    file = open_gguf(path)
    metadata = read_metadata(file)
    tensors = {t.name: t for t in file.tensors}
    embd = tensors.get("token_embd.weight")
    config = config_from_metadata(
        metadata, num_tokens=int(embd.shape[-1]) if embd is not None else None)
    _check_tensor_names(tensors, config.num_layers, _architecture(metadata)[1])
    return GGUFHeader(path=os.fspath(path), metadata=metadata, config=config, file=file)


def load_gguf_model(path):
    """Load a Llama-family or Gemma 3 GGUF: config, float32 weights, metadata.

    Parameters
    ----------
    path : str or os.PathLike or GGUFHeader
        A header from :func:`read_gguf_header` is loaded without re-reading
        the metadata.

    Returns
    -------
    GGUFModel

    Raises
    ------
    FileNotFoundError, IsADirectoryError, ModelFormatError
        As :func:`read_gguf_header`; also for misshapen tensors.
    MissingDependencyError
        The ``gguf`` package is not installed.
    """
    header = path if isinstance(path, GGUFHeader) else read_gguf_header(path)
    metadata, config = header.metadata, header.config
    arch, architecture = _architecture(metadata)
    tensors = {t.name: t for t in header.file.tensors}

    def weight(name):
        return _dequantize(tensors[name])

    layers = []
    for i in range(config.num_layers):
        layers.append(architecture.layer_class.from_projections(
            **{keyword: weight(f"blk.{i}.{name}.weight")
               for name, keyword in architecture.layer_tensors.items()}))
    freq_factors = weight("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    scale = float(metadata.get(f"{arch}.rope.scaling.factor") or 1.0)
    if arch in LLAMA_ARCHITECTURES and metadata.get(f"{arch}.rope.scaling.type") == "linear" \
            and scale != 1.0:
        # Linear scaling divides every position by the factor: fold it into the frequencies.
        base = np.ones(config.rope_dim // 2, np.float32) if freq_factors is None else freq_factors
        freq_factors = base * np.float32(scale)
    weights = LlamaWeights(
        token_embedding=weight("token_embd.weight"),
        layers=layers,
        output_norm=weight("output_norm.weight"),
        output=weight("output.weight") if "output.weight" in tensors else None,
        rope_freq_factors=freq_factors)
    try:
        model = architecture.model_class(config, weights)
    except ValueError as exc:
        raise ModelFormatError(f"model: tensor shapes disagree with the metadata: {exc}") from exc
    return GGUFModel(path=header.path, model=model, metadata=metadata)
