"""pagedkv.hf without a model: what ``import`` does, and the configs it reads or refuses.

``import pagedkv`` never imports torch or transformers; ``pagedkv.hf`` without
them says which extra to install (child interpreters: this process may have
imported them).  A transformers config is read into the cache's shape,
windows and variants, and one pagedkv cannot serve is an
``UnsupportedModelError`` naming the field, before anything is allocated.
"""
import pytest

from hf_models import require_hf
from python_child import run_python


def test_import_pagedkv_imports_neither_torch_nor_transformers():
    result = run_python("import sys, pagedkv, pagedkv.models.engine\n"
                        "print(sorted(m for m in ('torch', 'transformers', 'pagedkv.hf') "
                        "if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("missing", ["transformers", "torch"])
def test_pagedkv_hf_without_its_dependencies_names_the_extra(missing):
    result = run_python(f"import sys\nsys.modules[{missing!r}] = None   # as if not installed\n"
                        f"try:\n    import pagedkv.hf\nexcept ImportError as exc:\n"
                        f"    print(type(exc).__name__, exc)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ImportError pagedkv.hf needs torch and transformers")
    assert 'pip install "pagedkv[hf]" torch' in result.stdout


# -- configs --------------------------------------------------------------------------------
def tiny_llama_config(**overrides):
    require_hf()
    from transformers import LlamaConfig
    options = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128, vocab_size=100)
    options.update(overrides)
    return LlamaConfig(**options)


def test_the_config_is_read():
    require_hf()
    import pagedkv.hf
    from transformers import Gemma3TextConfig
    spec = pagedkv.hf.read_model_attention(Gemma3TextConfig(
        num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention",
                                          "full_attention"],
        sliding_window=64, head_dim=32, num_attention_heads=4, num_key_value_heads=1,
        query_pre_attn_scalar=16, attn_logit_softcapping=30.0))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (3, 4, 1, 32)
    assert spec.layer_windows == (64, 64, None)
    assert spec.scale == pytest.approx(0.25) and spec.logits_soft_cap == 30.0
    assert pagedkv.hf.read_model_attention(tiny_llama_config()).layer_windows == (None, None)


def test_chunked_layers_attend_with_their_chunk():
    require_hf()
    import pagedkv.hf
    from transformers import Llama4TextConfig
    spec = pagedkv.hf.read_model_attention(Llama4TextConfig(num_hidden_layers=4,
                                                            attention_chunk_size=512))
    assert spec.layer_chunks == (512, 512, 512, None)
    assert spec.layer_windows == (None,) * 4     # chunked layers keep K/V in the full pool


def _with_attribute(config, name, value):
    setattr(config, name, value)
    return config


def _with_layer_types(types):
    config = tiny_llama_config()
    config.layer_types = types
    return config


@pytest.mark.parametrize("config, named", [
    # linear attention of a model whose mixer pagedkv.hf does not route (tests/test_hf_hybrid.py
    # has the ones it serves)
    (lambda: __import__("transformers").KimiLinearConfig(num_hidden_layers=4),
     r"config.layer_types\[0\]: 'linear_attention' layers of kimi_linear have no mapping"),
    (lambda: _with_layer_types(["full_attention", "mystery_attention"]),
     r"config.layer_types\[1\]: 'mystery_attention' has no mapping"),
    (lambda: tiny_llama_config(num_attention_heads=4, num_key_value_heads=3),
     "config.num_key_value_heads: 3 does not divide num_attention_heads=4"),
    (lambda: __import__("transformers").Gemma3TextConfig(use_bidirectional_attention=True),
     "config.use_bidirectional_attention"),
    (lambda: _with_attribute(__import__("transformers").DeepseekV3Config(num_hidden_layers=2),
                             "qk_rope_head_dim", 0),
     "config.qk_rope_head_dim: expected a positive int"),
    (lambda: __import__("transformers").T5Config(), "config.is_encoder_decoder"),
    (lambda: {"num_hidden_layers": 2}, "config: expected a transformers PretrainedConfig"),
])
def test_configs_pagedkv_cannot_serve_are_named(config, named):
    require_hf()
    import pagedkv.hf
    with pytest.raises(pagedkv.hf.UnsupportedModelError, match=named):
        pagedkv.hf.PagedCache(config(), num_pages=4, backend="host")


def test_a_head_dim_the_backend_cannot_take_is_named():
    require_hf()
    import pagedkv
    import pagedkv.hf
    if "opencl" not in pagedkv.available_backends():
        pytest.skip("needs an OpenCL device (the host backend takes any head_dim)")
    config = tiny_llama_config(head_dim=4096, hidden_size=64)
    with pytest.raises(pagedkv.hf.UnsupportedModelError,
                       match="config.head_dim: 4096 .* cannot be served by the 'opencl' backend"):
        pagedkv.hf.PagedCache(config, num_pages=1, backend="opencl")
