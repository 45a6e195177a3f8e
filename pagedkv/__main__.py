"""``python -m pagedkv <command>``: command-line jobs built on the library.

Commands import lazily, so the core never needs their optional dependencies.
"""
import importlib
import sys
from typing import Optional, Sequence

# command -> (module with main(argv) -> int, one-line description)
COMMANDS = {
    "demo": ("pagedkv.models.demo",
             "serve a real model (SmolLM2-135M by default, or Gemma 3 270M) through pagedkv "
             "with continuous batching"),
}


def usage() -> str:
    lines = ["usage: python -m pagedkv <command> [options]",
             "       python -m pagedkv --version", "", "commands:"]
    lines += [f"  {name:<8}{description}" for name, (_, description) in COMMANDS.items()]
    lines += ["", "python -m pagedkv <command> --help shows a command's options."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch to a command; return its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from pagedkv._version import __version__
        print(f"pagedkv {__version__}")
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
