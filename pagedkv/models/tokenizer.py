"""The tokenizer of a GGUF model, built with the ``tokenizers`` library from the file's metadata.

A GGUF with ``tokenizer.ggml.model == "gpt2"`` stores a byte-level BPE: the
vocabulary (``tokenizer.ggml.tokens``, already in the GPT-2 byte-to-unicode
alphabet), the merge list (``tokenizer.ggml.merges``) and the name of the
pre-tokenizer split (``tokenizer.ggml.pre``).  Those map one to one onto a
``tokenizers`` BPE model with a ByteLevel pre-tokenizer and decoder; control
tokens (``<|im_start|>`` ...) become special added tokens so that chat
templates can use them.

A GGUF with ``tokenizer.ggml.model == "llama"`` (Llama 2, TinyLlama, Mistral
v0.1, Gemma, ...) stores a SentencePiece BPE: pieces with scores, ``<0xNN>``
byte pieces, spaces written as ``▁``.  It becomes a ``tokenizers`` BPE with
byte fallback whose merges rank pairs by the score of the piece they make,
which is how SentencePiece's BPE picks its merges (and how Hugging Face
converts these tokenizers); user-defined pieces rank first (see
:func:`_sentencepiece_merges`).  ``tokenizer.ggml.add_space_prefix`` says
whether a ``▁`` is prepended (Llama 2: yes; Gemma: no).

Chat prompts are rendered with the model's own ``tokenizer.chat_template``
(Jinja, through ``jinja2``'s sandbox, as Hugging Face does).  Without
``jinja2``, ChatML templates (SmolLM2, Qwen, ...) fall back to a built-in
ChatML renderer.
"""
import re
import warnings
from typing import List, Sequence

from pagedkv.models.errors import DEMO_INSTALL, MissingDependencyError, ModelFormatError

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                 r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> the regex splits applied before byte-level BPE, in order
# (as llama.cpp's llama-vocab.cpp pairs them).  ``"digits"`` isolates every digit.
_PRE_TOKENIZERS = {
    **{name: ("gpt2",) for name in ("default", "gpt2", "gpt-2")},
    **{name: ("digits", "gpt2") for name in (
        "smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")},
    **{name: ("llama3",) for name in ("llama3", "llama-bpe", "llama-v3", "dbrx", "smaug-bpe")},
}

# Text of tokens that end a turn, whatever the model (llama.cpp's end-of-generation list).
_END_OF_TURN_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                      "<EOT>", "<|end_of_text|>", "</s>")


def _import_tokenizers():
    try:
        import tokenizers
    except ImportError as exc:
        raise MissingDependencyError(
            f"the model tokenizer needs the tokenizers package: {DEMO_INSTALL}") from exc
    return tokenizers


def _pre_tokenizer(pre_name):
    """The ``tokenizers`` pre-tokenizer for a GGUF ``tokenizer.ggml.pre`` name."""
    from tokenizers import Regex, pre_tokenizers
    steps = _PRE_TOKENIZERS.get(pre_name)
    if steps is None:
        warnings.warn(f"tokenizer: unknown pre-tokenizer {pre_name!r}; splitting text as GPT-2 "
                      f"does, which may tokenize some text differently from llama.cpp",
                      stacklevel=3)
        steps = ("gpt2",)
    parts = []
    for step in steps:
        if step == "digits":
            parts.append(pre_tokenizers.Digits(individual_digits=True))
        else:
            pattern = _GPT2_SPLIT if step == "gpt2" else _LLAMA3_SPLIT
            parts.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
    # The splits above did the word splitting; ByteLevel only maps bytes to symbols.
    parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(parts)


class GGUFTokenizer:
    """Encode and decode text for a GGUF model; render its chat template.

    Build it with :meth:`from_metadata`.

    Attributes
    ----------
    vocab_size : int
    bos_id, eos_id : int or None
    add_bos : bool
        Whether encoding prepends ``bos_id`` (``tokenizer.ggml.add_bos_token``).
    stop_ids : frozenset of int
        Ids that end generation: ``eos_id`` plus any end-of-turn control token.
    chat_template : str or None
    """

    def __init__(self, tokenizer, *, token_texts, bos_id, eos_id, add_bos, stop_ids,
                 chat_template):
        self._tokenizer = tokenizer
        self._token_texts = token_texts
        self.vocab_size = len(token_texts)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.stop_ids = frozenset(stop_ids)
        self.chat_template = chat_template
        self._render = None

    @classmethod
    def from_metadata(cls, metadata):
        """Build the tokenizer of a GGUF from its metadata.

        Parameters
        ----------
        metadata : dict
            GGUF key-value fields (:func:`pagedkv.models.gguf_loader.read_metadata`).

        Raises
        ------
        ModelFormatError
            No tokenizer in the file, or one of another kind than byte-level
            BPE (``gpt2``) or SentencePiece BPE (``llama``).
        MissingDependencyError
            ``tokenizers`` is not installed.
        """
        _import_tokenizers()
        from tokenizers import AddedToken
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise ModelFormatError(
                f"tokenizer: expected a byte-level BPE ('gpt2') or SentencePiece BPE ('llama') "
                f"tokenizer.ggml.model, got {kind!r}")
        tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ModelFormatError("tokenizer: the GGUF lacks tokenizer.ggml.tokens")
        types = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise ModelFormatError(f"tokenizer: tokenizer.ggml.token_type has {len(types)} "
                                   f"entries for {len(tokens)} tokens")
        if len(set(tokens)) != len(tokens):
            raise ModelFormatError("tokenizer: tokenizer.ggml.tokens has duplicate entries")
        if kind == "gpt2":
            tokenizer = _byte_level_bpe(tokens, metadata)
        else:
            tokenizer = _sentencepiece_bpe(tokens, types, metadata)
        special = [i for i, t in enumerate(types) if t == _CONTROL]
        # User-defined tokens are matched in the raw text before the BPE runs,
        # except SentencePiece's pieces with spaces, which the BPE merges.
        user_defined = [i for i, t in enumerate(types) if t == _USER_DEFINED
                        and not (kind == "llama" and " " in tokens[i])]
        tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                      for i in special])
        tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                              for i in user_defined])

        def token_id(key):
            value = metadata.get(key)
            return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

        bos_id, eos_id = token_id("tokenizer.ggml.bos_token_id"), \
            token_id("tokenizer.ggml.eos_token_id")
        stop_ids = {i for i in (eos_id, token_id("tokenizer.ggml.eot_token_id"),
                                token_id("tokenizer.ggml.eom_token_id")) if i is not None}
        stop_ids |= {i for i in special if tokens[i] in _END_OF_TURN_TEXTS}
        # llama.cpp's default: SentencePiece vocabularies add BOS, byte-level ones do not.
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
        return cls(tokenizer, token_texts=tokens, bos_id=bos_id, eos_id=eos_id,
                   add_bos=bool(add_bos) and bos_id is not None,
                   stop_ids=stop_ids, chat_template=metadata.get("tokenizer.chat_template"))

    # -- text <-> ids ---------------------------------------------------------------
    def encode(self, text, *, add_bos=None):
        """Token ids of ``text``; control tokens written in it (``<|im_start|>``) are parsed.

        Parameters
        ----------
        text : str
        add_bos : bool, optional
            Prepend ``bos_id``; default: the model's ``add_bos`` (never twice).

        Returns
        -------
        list of int
        """
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        add_bos = self.add_bos if add_bos is None else add_bos
        if add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, *, skip_special=True):
        """Text of token ids (control tokens dropped when ``skip_special``)."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_text(self, token_id):
        """The vocabulary entry of one id, e.g. ``'ĠParis'`` (byte-level symbols)."""
        return self._token_texts[token_id]

    # -- chat ------------------------------------------------------------------------
    def apply_chat_template(self, messages, *, add_generation_prompt=True):
        """Render chat ``messages`` with the model's template.

        Parameters
        ----------
        messages : list of dict
            ``{"role": "system" | "user" | "assistant", "content": str}``.
        add_generation_prompt : bool
            End with the header of the assistant's turn.

        Returns
        -------
        str
        """
        if self._render is None:
            self._render = _template_renderer(self.chat_template, self)
        return self._render(list(messages), add_generation_prompt)

    def encode_chat(self, messages, *, add_generation_prompt=True):
        """Token ids of ``messages`` rendered by :meth:`apply_chat_template`."""
        return self.encode(self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt))


def _byte_level_bpe(tokens, metadata):
    """A ``tokenizers.Tokenizer`` for a GGUF byte-level BPE (``tokenizer.ggml.model == "gpt2"``)."""
    from tokenizers import Tokenizer, decoders, models
    merges = list(metadata.get("tokenizer.ggml.merges") or [])
    if not merges:
        raise ModelFormatError("tokenizer: the GGUF lacks tokenizer.ggml.merges")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelFormatError(f"tokenizer: malformed merge {merge!r}")
        pairs.append((left, right))
    vocab = {text: i for i, text in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_pieces(tokens, types):
    """The SentencePiece pieces of a GGUF vocabulary (spaces written ``▁``).

    llama.cpp's converter writes user-defined pieces with plain spaces
    (``"▁▁"`` becomes ``"  "``, so that its tokenizer can match them in raw
    text); this undoes that, making them pieces of the BPE again, which is
    how SentencePiece and Hugging Face's Gemma tokenizer treat them (runs of
    spaces are then merged by the BPE, not matched greedily).

    Parameters
    ----------
    tokens : list of str, length vocab_size
    types : list of int, length vocab_size

    Returns
    -------
    list of str, length vocab_size
    """
    return [t.replace(" ", "\u2581") if kind == _USER_DEFINED else t
            for t, kind in zip(tokens, types)]


def _sentencepiece_merges(pieces, types, scores, vocab):
    """BPE merges that reproduce SentencePiece's choice of pieces, best first.

    SentencePiece's BPE joins the adjacent pair whose joined piece scores
    highest; a BPE whose merges are ranked by the score of the piece they
    make does the same (Hugging Face's conversion of these tokenizers).
    User-defined pieces rank first, in vocabulary order: SentencePiece scores
    them 0, above every learned piece, and llama.cpp's converter overwrote
    that with -1000.  Equal scores keep vocabulary order; a piece's own
    splits are ordered by the ids of their left and right halves.

    Returns
    -------
    list of (str, str)
    """
    ranked = []
    for i, kind in enumerate(types):
        if kind not in (_NORMAL, _USER_DEFINED):
            continue
        piece = pieces[i]
        splits = [(vocab[piece[:cut]], vocab[piece[cut:]]) for cut in range(1, len(piece))
                  if piece[:cut] in vocab and piece[cut:] in vocab]
        priority = float("inf") if kind == _USER_DEFINED else float(scores[i])
        ranked.extend((priority, pieces[left], pieces[right]) for left, right in sorted(splits))
    ranked.sort(key=lambda m: -m[0])                     # stable: ties keep vocabulary order
    return [m[1:] for m in ranked]


def _sentencepiece_bpe(tokens, types, metadata):
    """A ``tokenizers.Tokenizer`` for a GGUF SentencePiece BPE (tokenizer.ggml.model "llama")."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    scores = list(metadata.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise ModelFormatError("tokenizer: a SentencePiece GGUF needs tokenizer.ggml.scores, one "
                               "per token")
    pieces = sentencepiece_pieces(tokens, types)
    vocab = {text: i for i, text in enumerate(pieces)}
    if len(vocab) != len(pieces):
        raise ModelFormatError("tokenizer: tokenizer.ggml.tokens has entries that differ only "
                               "in spaces written as ' ' or '\u2581'")
    merges = _sentencepiece_merges(pieces, types, scores, vocab)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = pieces[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(pieces) else None
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk,
                                     fuse_unk=True, byte_fallback=True))
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    return tokenizer


def _template_renderer(template, tokenizer):
    """A ``render(messages, add_generation_prompt) -> str`` for a chat template."""
    if not template:
        raise ModelFormatError("tokenizer: the GGUF has no tokenizer.chat_template; "
                               "feed prompts as plain text (--raw)")
    try:
        import jinja2.sandbox
    except ImportError:
        if "<|im_start|>" in template:
            return _chatml_renderer(template)
        raise MissingDependencyError(
            f"rendering this model's chat template needs jinja2: {DEMO_INSTALL}") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    # The environment Hugging Face renders chat templates in.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)
    texts = {"bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id}
    texts = {k: tokenizer.token_text(v) if v is not None else "" for k, v in texts.items()}

    def render(messages, add_generation_prompt):
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **texts)
    return render


def _chatml_renderer(template):
    """ChatML without jinja2, with the template's default system prompt if it has one."""
    found = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.S)
    default_system = found.group(1) if found else None

    def render(messages, add_generation_prompt):
        parts = []
        if default_system is not None and (not messages or messages[0]["role"] != "system"):
            parts.append(f"<|im_start|>system\n{default_system}<|im_end|>\n")
        for message in messages:
            parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)
    return render


class TextStream:
    """Turn a growing list of token ids into text increments.

    Byte-level BPE tokens can split a UTF-8 character; text is only released
    once it no longer ends in an incomplete character.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: List[int] = []
        self.text = ""

    def push(self, token_id):
        """Add one generated id; return the newly completed text (maybe ``""``)."""
        self._ids.append(int(token_id))
        text = self._tokenizer.decode(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.text = text[len(self.text):], text
        return new


def encode_prompts(tokenizer, prompts: Sequence[str], *, chat: bool) -> List[List[int]]:
    """Token ids of each prompt: as a one-message chat (``chat=True``) or as plain text."""
    if chat:
        return [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    return [tokenizer.encode(p) for p in prompts]


__all__ = ["GGUFTokenizer", "TextStream", "encode_prompts"]
