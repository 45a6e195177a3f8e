"""pagedkv under transformers for multi-head latent attention: tiny random DeepSeek V2 and
V3 models (V3 with YaRN's ``mscale_all_dim``, which changes the logit scale) give eager
attention's greedy tokens, with logits within 1e-4 relative, through ``generate`` (a
left-padded batch) and ``generate_batch`` (continuous batching, chunked prefill, prefix
reuse), on every backend; the cache keeps one latent row per token."""
import numpy as np
import pytest

from hf_models import one_torch_thread, padded, require_hf

# whole models, so one OpenCL device is enough
pytestmark = pytest.mark.one_opencl_device

NEW_TOKENS = 6
PROMPTS = [np.random.default_rng(seed).integers(3, 300, n).tolist()
           for seed, n in [(1, 7), (2, 37), (3, 20)]]
WIDTHS = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20)
LOGITS_RTOL = 1e-4


def tiny(kind):
    """A tiny random DeepSeek model (two layers: a dense one and a mixture of experts)."""
    import torch
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)
    torch.manual_seed(0)
    common = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
                  max_position_embeddings=256, moe_intermediate_size=32, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  n_group=1, topk_group=1, **WIDTHS)
    if kind == "v3":
        config = DeepseekV3Config(**common, rope_parameters=dict(
            rope_type="yarn", factor=4.0, rope_theta=10000.0,
            original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0,
            beta_fast=32, beta_slow=1))
        model = DeepseekV3ForCausalLM(config)
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**common))
    return model.eval()


@pytest.fixture(scope="module", autouse=True)
def _threads():
    require_hf()
    import pagedkv.hf  # noqa: F401  (registers "pagedkv")
    with one_torch_thread():
        yield


@pytest.fixture(scope="module", params=["v2", "v3"])
def model_and_oracle(request):
    """The model (attention "pagedkv") and eager attention's tokens and logits per prompt."""
    import torch
    model = tiny(request.param)
    model.set_attn_implementation("eager")
    oracle = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]),
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            oracle.append((out.sequences[0, len(prompt):].tolist(),
                           torch.stack(out.logits)[:, 0]))
    model.set_attn_implementation("pagedkv")
    return model, oracle


def test_the_config_maps_onto_a_latent_cache():
    import pagedkv.hf
    spec = pagedkv.hf.read_model_attention(tiny("v3").config)
    assert (spec.num_kv_heads, spec.head_dim, spec.v_head_dim, spec.kv_layout) == \
        (1, 48, 32, "latent")
    # (24 + 16) ** -0.5 times YaRN's mscale squared: (0.1 * ln 4 + 1) ** 2
    assert spec.scale == pytest.approx(40 ** -0.5 * (0.1 * np.log(4.0) + 1) ** 2)
    cache = pagedkv.hf.PagedCache(tiny("v2").config, num_pages=8, backend="host")
    assert cache.kv.kv_layout == "latent" and cache.kv.memory_bytes == 2 * 8 * 16 * 48 * 4


def test_generate_on_a_padded_batch(model_and_oracle, backend):
    import torch
    import pagedkv.hf
    model, oracle = model_and_oracle
    input_ids, mask = padded(PROMPTS, 0, "left")
    cache = pagedkv.hf.PagedCache(model.config, num_pages=32, backend=backend)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    logits = torch.stack(out.logits)
    for row, (tokens, want) in enumerate(oracle):
        assert out.sequences[row, input_ids.shape[1]:].tolist() == tokens
        got = logits[:, row]
        assert float((got - want).abs().max() / want.abs().max()) < LOGITS_RTOL
    # one latent row per real token and layer: no per-head K/V
    assert sum(cache.kv.seq_len(s) for s in cache.rows) == \
        sum(map(len, PROMPTS)) + len(PROMPTS) * (NEW_TOKENS - 1)


def test_generate_batch_and_prefix_reuse(model_and_oracle, backend):
    import pagedkv.hf
    model, oracle = model_and_oracle
    cache = pagedkv.hf.PagedCache(model.config, num_pages=64, backend=backend,
                                  enable_prefix_caching=True)
    tokens = [t for t, _ in oracle]
    got = pagedkv.hf.generate_batch(model, PROMPTS, NEW_TOKENS, cache=cache,
                                    max_num_batched_tokens=24)
    assert got == tokens
    stored = cache.stats()["num_stored_tokens"]
    again = pagedkv.hf.generate_batch(model, PROMPTS[1:2], NEW_TOKENS, cache=cache)
    assert again == tokens[1:2]
    # the repeated 37-token prompt reuses its two cached pages
    assert cache.stats()["num_stored_tokens"] - stored <= 37 - 32 + NEW_TOKENS
