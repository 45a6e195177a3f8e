"""The examples a user copies run as written and compute what they claim.

- ``examples/engine_loop.py`` (a toy decoder over ``PagedKVCache``): it runs
  as a script, and the logits of every generated token equal a dense,
  cache-free forward pass over the same tokens, on every backend;
- the README's API snippet and the prefix-caching snippet of
  ``docs/prefix-caching.md``, extracted and executed as they stand;
- ``examples/latent_attention.py`` (multi-head latent attention over a
  ``kv_layout="latent"`` cache): it runs as a script, and on every backend its
  absorbed attention equals the expanded form it checks itself against;
- ``examples/hybrid_layer.py`` (a gated DeltaNet layer with its state in the
  cache): it runs as a script, and on every backend its outputs equal the
  layer run from scratch, which it checks itself;
- the transformers examples (``examples/hf_*.py``: attention only, ``generate``,
  ``generate_batch``) run on SmolLM2 and print what they claim.
"""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reference import dense_attention

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ENGINE_LOOP = ROOT / "examples" / "engine_loop.py"
LATENT = ROOT / "examples" / "latent_attention.py"
HYBRID = ROOT / "examples" / "hybrid_layer.py"
README = ROOT / "README.md"
PREFIX_CACHING_DOC = ROOT / "docs" / "prefix-caching.md"


def load_example(path):
    if not path.exists():
        pytest.skip(f"{path} is not here (tests run from a copy without the repository)")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_loop_runs_as_written(tmp_path):
    load_example(ENGINE_LOOP)
    result = subprocess.run([sys.executable, str(ENGINE_LOOP), "--max-new-tokens", "4"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and all(" -> [" in line for line in lines), result.stdout


def test_latent_example_runs_as_written(tmp_path):
    load_example(LATENT)
    result = subprocess.run([sys.executable, str(LATENT)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "2,304 per token" in result.stdout, result.stdout


def test_latent_example_matches_the_expanded_form(backend, capsys):
    load_example(LATENT).main(decode_steps=2, backend=backend)   # it asserts every step
    assert capsys.readouterr().out.count("max |absorbed - expanded|") == 3


def test_hybrid_example_runs_as_written(tmp_path):
    load_example(HYBRID)
    result = subprocess.run([sys.executable, str(HYBRID)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "prefix hit: 32 of 41" in result.stdout, result.stdout
    assert "rolled back" in result.stdout and "matched" in result.stdout, result.stdout


def test_hybrid_example_matches_the_layer_from_scratch(backend, capsys):
    load_example(HYBRID).main(backend=backend)     # it asserts every step
    assert "prefix hit: 32 of 41" in capsys.readouterr().out


def dense_logits(model, tokens):
    """The model over one whole sequence with dense causal attention (no cache)."""
    positions = np.arange(len(tokens))

    def attend(layer, q, k, v):
        return dense_attention(q, k, v, positions).astype(np.float32)

    return model.forward(np.asarray(tokens), positions, attend)


def test_engine_loop_logits_equal_a_dense_forward_pass(backend):
    example = load_example(ENGINE_LOOP)
    model = example.ToyDecoder()
    prompts = [[1, 2, 3, 4, 5], [10, 20, 30], [7] * 40]   # the last spans three pages of 16
    max_new = 6
    generated, logits = example.generate(model, prompts, max_new, backend=backend)
    for prompt, new, got in zip(prompts, generated, logits):
        assert len(new) == max_new and got.shape == (max_new, 96)
        # teacher forcing: the row of each position that picked a generated token
        want = dense_logits(model, prompt + new[:-1])[len(prompt) - 1:]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        assert new == [int(row.argmax()) for row in got]


def first_python_block(path, heading=None):
    """The first ```python block of the Markdown file ``path`` (after the line
    ``heading``, if given)."""
    if not path.exists():
        pytest.skip(f"{path} is not here (tests run from a copy without the repository)")
    text = path.read_text()
    start = 0 if heading is None else text.index(f"\n{heading}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match, f"no python block in {path} after {heading!r}"
    return match.group(1)


def test_readme_api_snippet_runs_as_written():
    namespace = {}
    exec(compile(first_python_block(README, "## The API in brief"), str(README), "exec"),
         namespace)
    cache, a, b = namespace["cache"], namespace["a"], namespace["b"]
    assert namespace["out"].shape == (107, 32, 128)
    assert cache.seq_len(a) == 100                       # restored to the checkpoint
    assert namespace["k"].shape == (cache.seq_len(b), 8, 128) == (8, 8, 128)
    assert namespace["c"] not in cache.seq_ids()        # freed


def test_prefix_caching_snippet_runs_as_written(capsys):
    namespace = {}
    exec(compile(first_python_block(PREFIX_CACHING_DOC), str(PREFIX_CACHING_DOC), "exec"),
         namespace)
    cache = namespace["cache"]
    # the second request of the same 100-token prompt reused its six full pages
    assert namespace["done"] == 96
    assert "prefix_hit_rate" in capsys.readouterr().out
    assert cache.stats()["num_cached_pages"] == 0          # after reset_prefix_cache()
    assert cache.num_free_pages == cache.num_pages


@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [
    # greedy SmolLM2: its known continuation, and what each example says about the cache
    ("hf_attention", [r"in no particular order: Paris,' -> ' Rome, London,",
                      r"the two sequences share 1 page\(s\) of the prompt"]),
    ("hf_generate", [r"'The capital of France is' -> ' Paris\.", r"hold \[\d+, \d+, \d+\] "
                     r"tokens \(no padding\)"]),
    ("hf_generate_batch", [r"'What is the capital of France\?' -> 'The capital of France is "
                           r"Paris\.'", r"[1-9]\d*% of them reused from the prefix cache"]),
])
def test_transformers_examples_run_as_written(name, expected, hf_converted_dir, capsys,
                                              monkeypatch):
    """In this process (their main(argv)): torch and transformers are imported already."""
    from hf_models import one_torch_thread, require_hf, smollm2_folder
    require_hf()
    monkeypatch.syspath_prepend(str(EXAMPLES))          # their shared hf_common.py
    example = load_example(EXAMPLES / f"{name}.py")
    with one_torch_thread():
        example.main(["--model", str(smollm2_folder(hf_converted_dir)), "--backend", "host",
                      "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    for pattern in expected:
        assert re.search(pattern, out), (pattern, out)
