"""A transformers model with chunked local attention layers (Llama 4's
``chunked_attention``) served through pagedkv: a tiny randomly initialised
Llama 4 text model gives the logits and the greedy tokens of transformers' own
``sdpa`` attention on every backend, over prompts longer than several chunks.
"""
import numpy as np
import pytest

from hf_models import one_torch_thread, require_hf

CHUNK = 8


@pytest.fixture(scope="module")
def tiny_llama4():
    require_hf()
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    torch.manual_seed(0)
    config = Llama4TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, intermediate_size_mlp=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_chunk_size=CHUNK, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=2, max_position_embeddings=256)
    assert "chunked_attention" in config.layer_types and "full_attention" in config.layer_types
    return Llama4ForCausalLM(config).eval()


def _with_attention(model, name, run):
    model.set_attn_implementation(name)
    try:
        return run()
    finally:
        model.set_attn_implementation("sdpa")


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    with one_torch_thread():
        yield


def test_chunked_layers_give_sdpas_logits_and_tokens(tiny_llama4, backend):
    import torch

    import pagedkv.hf
    prompt = torch.randint(0, 128, (1, 3 * CHUNK + 5), generator=torch.Generator().manual_seed(1))

    def cache():
        return pagedkv.hf.PagedCache(tiny_llama4.config, num_pages=64, page_size=4,
                                     backend=backend)

    with torch.no_grad():
        want_logits = tiny_llama4(prompt).logits
        want = tiny_llama4.generate(prompt, max_new_tokens=2 * CHUNK, do_sample=False)
        got_logits = _with_attention(tiny_llama4, "pagedkv",
                                     lambda: tiny_llama4(prompt, past_key_values=cache()).logits)
        got = _with_attention(tiny_llama4, "pagedkv", lambda: tiny_llama4.generate(
            prompt, max_new_tokens=2 * CHUNK, do_sample=False, past_key_values=cache()))
    np.testing.assert_allclose(got_logits.numpy(), want_logits.numpy(), atol=2e-5, rtol=1e-4)
    assert got.tolist() == want.tolist()
