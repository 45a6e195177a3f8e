"""``python -m pagedkv demo --disaggregated``: prefill and decode in two Ray actors on a
local Ray cluster (2 CPUs) give the same tokens as the single-process demo.

Ray starts once for the module, and nothing here runs per backend or OpenCL
device: the actors run the host backend (the K/V's path between them does
not depend on it; export and import on every backend are tests/test_transfer.py's).
"""
import os

import pytest

from test_model_demo import run, tiny_llama  # noqa: F401  (the tiny GGUF fixture)
from test_model_gguf import require

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    require("gguf", "tokenizers", "rich")
    # Ray puts the driver's working directory first on its workers' sys.path. From
    # the repository root that is the unbuilt source tree, which would shadow the
    # installed pagedkv that this process imports; start Ray from elsewhere.
    here = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("ray"))
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    finally:
        os.chdir(here)
    yield
    ray.shutdown()


def test_disaggregated_demo_gives_the_single_process_tokens(local_ray, request, capsys):
    args = ["--model", request.getfixturevalue("tiny_llama"), "--raw", "--prompt", " the a the", "--prompt", " a",
            "--prompt", " the the a a the", "--max-new-tokens", "8", "--backend", "host",
            "--page-size", "4", "--stagger", "1"]
    status, single, err = run(capsys, *args)
    assert status == 0, err
    status, disaggregated, err = run(capsys, *args, "--disaggregated")
    assert status == 0, err
    assert disaggregated == single and single.count("### Prompt") == 3
    assert "disaggregated: prefill and decode in two Ray actors" in err
    assert "3 prompts, 24 tokens generated" in err
    assert "K/V transfer, prefill actor -> decode actor: 3 requests of" in err
