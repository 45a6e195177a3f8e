"""Loading a transformers causal LM from a folder or a GGUF file, and its tokenizer for the demo.

transformers reads a GGUF file by dequantizing every tensor in Python, which
takes a minute for a small model; :func:`load_causal_lm` can keep the result in
a folder (``save_pretrained``: safetensors) so that later loads take seconds.
"""
import hashlib
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Union, cast

import torch

if TYPE_CHECKING:   # annotations only: transformers is imported where it is used
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from pagedkv.models.tokenizer import GGUFTokenizer

_Path = Union[str, "os.PathLike[str]"]


def is_gguf(path: _Path) -> bool:
    """Whether ``path`` is a GGUF file (by its magic bytes)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def converted_folder(path: _Path, converted_dir: _Path) -> Path:
    """Where :func:`load_causal_lm` keeps the dequantized copy of GGUF ``path`` in
    ``converted_dir``: named by the file's identity and the transformers version, so a
    changed file or library converts again.

    Returns
    -------
    pathlib.Path
    """
    import transformers
    path = Path(os.fspath(path))
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|"
                         f"{transformers.__version__}".encode()).hexdigest()[:16]
    return Path(converted_dir) / f"{path.stem}-{key}"


def load_causal_lm(path: _Path, *, attn_implementation: str = "pagedkv",
                   dtype: torch.dtype = torch.float32,
                   converted_dir: Optional[_Path] = None) -> "PreTrainedModel":
    """A transformers ``AutoModelForCausalLM`` from a model folder or a GGUF file, in eval mode.

    Parameters
    ----------
    path : str or os.PathLike
        A folder ``from_pretrained`` reads, or a GGUF file (loaded with
        ``from_pretrained(folder, gguf_file=name)``, dequantized).
    attn_implementation : str, default "pagedkv"
        Import :mod:`pagedkv.hf` first for ``"pagedkv"``.
    dtype : torch.dtype, default torch.float32
    converted_dir : str or os.PathLike, optional
        For a GGUF file: a folder where its dequantized weights are kept.  The
        first load writes them there (atomically: a temporary folder renamed
        into place); later loads read them instead of the GGUF.

    Returns
    -------
    transformers.PreTrainedModel
    """
    from transformers import AutoModelForCausalLM

    path = Path(os.fspath(path))
    options = dict(dtype=dtype, attn_implementation=attn_implementation)
    if not is_gguf(path):
        return AutoModelForCausalLM.from_pretrained(path, **options).eval()
    if converted_dir is None:
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    **options).eval()
    folder = converted_folder(path, converted_dir)
    if not (folder / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=dtype)
        # the weights are dequantized now: saved as plain tensors, not as a GGUF again
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        folder.parent.mkdir(parents=True, exist_ok=True)
        scratch = tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-")
        model.save_pretrained(scratch)
        try:
            os.replace(scratch, folder)
        except OSError:                     # another process converted it first
            if not (folder / "config.json").is_file():
                raise
    return AutoModelForCausalLM.from_pretrained(folder, **options).eval()


class TransformersTokenizer:
    """A transformers tokenizer with the interface the demo uses of its own tokenizer.

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
    stop_ids : iterable of int
        Token ids that end a request.
    """

    def __init__(self, tokenizer: "PreTrainedTokenizerBase", stop_ids: Iterable[int]):
        self._tokenizer = tokenizer
        self.chat_template = tokenizer.chat_template
        self.stop_ids = set(int(t) for t in stop_ids)

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (with the special tokens the tokenizer adds)."""
        return list(self._tokenizer(text)["input_ids"])

    def encode_chat(self, messages: List[Dict[str, str]], *,
                    add_generation_prompt: bool = True) -> List[int]:
        """Token ids of ``messages`` through the chat template."""
        text = self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        # (one sequence of ids: one str; transformers types it with the batched form)
        return cast(str, self._tokenizer.decode(list(ids), skip_special_tokens=skip_special))


def load_tokenizer(path: _Path,
                   model: "PreTrainedModel") -> "Union[TransformersTokenizer, GGUFTokenizer]":
    """The demo's tokenizer for a model folder or GGUF file.

    A GGUF file gets the demo's own tokenizer from its metadata
    (:class:`pagedkv.models.tokenizer.GGUFTokenizer`, fast); a folder the
    transformers tokenizer saved in it, stopping at the model's
    ``eos_token_id`` and the tokenizer's.
    """
    if is_gguf(path):
        from pagedkv.models.gguf_loader import read_gguf_header
        from pagedkv.models.tokenizer import GGUFTokenizer
        return GGUFTokenizer.from_metadata(read_gguf_header(os.fspath(path)).metadata)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = model.generation_config.eos_token_id
    stop_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None:
        stop_ids.append(tokenizer.eos_token_id)
    return TransformersTokenizer(tokenizer, stop_ids)
