"""Read a Llama-family GGUF file: config from its metadata, float32 weights from its tensors.

Quantized tensors (Q4_1, Q8_0, ...) are dequantized once, at load, with
``gguf.quants.dequantize``; the engine then runs float32 matmuls.  The Q/K
weights are used exactly as the file stores them (permuted by llama.cpp's
converter for adjacent-pair RoPE, which :class:`pagedkv.models.llama.Rope`
implements).
"""
import os
from dataclasses import dataclass
from typing import Any, Dict

import numpy as np

from pagedkv.models.errors import DEMO_INSTALL, MissingDependencyError, ModelFormatError
from pagedkv.models.llama import LayerWeights, LlamaConfig, LlamaModel, LlamaWeights

#: ``general.architecture`` values whose tensors follow the Llama layout.
LLAMA_ARCHITECTURES = ("llama",)

_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_GLOBAL_TENSORS = ("token_embd", "output_norm", "output", "rope_freqs")


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
    model : LlamaModel
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
        return self.metadata.get("general.name") or os.path.basename(self.path)


def read_metadata(reader):
    """The key-value fields of an open ``gguf.GGUFReader`` as a dict of Python values."""
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue                  # header bookkeeping, not model metadata
        value = field.contents()
        metadata[key] = value
    return metadata


def open_gguf(path):
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped, nothing dequantized yet).

    Raises
    ------
    FileNotFoundError
        No such file.
    ModelFormatError
        The file is not a readable GGUF.
    """
    gguf = _import_gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model: no such file: {path!r}")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct errors, ... on garbage
        raise ModelFormatError(f"model: {path!r} is not a readable GGUF file ({exc})") from exc


def config_from_metadata(metadata, *, num_tokens=None):
    """A :class:`LlamaConfig` from GGUF metadata.

    Parameters
    ----------
    metadata : dict
        From :func:`read_metadata`.
    num_tokens : int, optional
        Rows of ``token_embd`` (used when ``{arch}.vocab_size`` is absent).

    Raises
    ------
    ModelFormatError
        Not a Llama-family model, or a required key is missing.
    """
    arch = metadata.get("general.architecture")
    if arch not in LLAMA_ARCHITECTURES:
        raise ModelFormatError(f"model: expected a Llama-family GGUF (general.architecture in "
                               f"{list(LLAMA_ARCHITECTURES)}), got {arch!r}")

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
    try:
        return LlamaConfig(
            vocab_size=int(vocab_size), hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length", required=True)),
            num_layers=int(get("block_count", required=True)),
            num_heads=num_heads, num_kv_heads=int(num_kv_heads), head_dim=head_dim,
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            max_position=int(get("context_length", 2048)))
    except ValueError as exc:
        raise ModelFormatError(f"model: inconsistent Llama metadata: {exc}") from exc


def _check_tensor_names(names, num_layers):
    """Refuse tensors this forward pass would silently ignore (biases, experts, ...)."""
    known = {f"{n}.weight" for n in _GLOBAL_TENSORS}
    known |= {f"blk.{i}.{n}.weight" for i in range(num_layers) for n in _LAYER_TENSORS}
    unknown = sorted(set(names) - known)
    if unknown:
        hint = " (mixture-of-experts)" if any("_exps" in n for n in unknown) else ""
        raise ModelFormatError(f"model: tensors this Llama engine does not support{hint}: "
                               f"{unknown[:6]}{' ...' if len(unknown) > 6 else ''}")
    missing = sorted(n for n in known - set(names)
                     if not n.startswith(("output.", "rope_freqs.")))
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
    return np.asarray(values, dtype=np.float32).reshape(shape)


def load_gguf_model(path):
    """Load a Llama-family GGUF: config, float32 weights, metadata.

    Parameters
    ----------
    path : str or os.PathLike

    Returns
    -------
    GGUFModel

    Raises
    ------
    FileNotFoundError, ModelFormatError
        As :func:`open_gguf` and :func:`config_from_metadata`; also for
        missing, unexpected or misshapen tensors.
    MissingDependencyError
        The ``gguf`` package is not installed.
    """
    reader = open_gguf(path)
    metadata = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    config = config_from_metadata(
        metadata, num_tokens=int(embd.shape[-1]) if embd is not None else None)
    _check_tensor_names(tensors, config.num_layers)

    def weight(name):
        return _dequantize(tensors[name])

    layers = []
    for i in range(config.num_layers):
        w = {n: weight(f"blk.{i}.{n}.weight") for n in _LAYER_TENSORS}
        layers.append(LayerWeights.from_projections(
            attn_norm=w["attn_norm"], wq=w["attn_q"], wk=w["attn_k"], wv=w["attn_v"],
            wo=w["attn_output"], ffn_norm=w["ffn_norm"], w_gate=w["ffn_gate"],
            w_up=w["ffn_up"], w_down=w["ffn_down"]))
    freq_factors = weight("rope_freqs.weight") if "rope_freqs.weight" in tensors else None
    arch = metadata["general.architecture"]
    scale = float(metadata.get(f"{arch}.rope.scaling.factor") or 1.0)
    if metadata.get(f"{arch}.rope.scaling.type") == "linear" and scale != 1.0:
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
        model = LlamaModel(config, weights)
    except ValueError as exc:
        raise ModelFormatError(f"model: tensor shapes disagree with the metadata: {exc}") from exc
    return GGUFModel(path=os.fspath(path), model=model, metadata=metadata)

