"""Run Python code in a child interpreter, the way a user's program runs.

The child starts in a scratch directory: Python puts the current directory
first on `sys.path` for `-c`, so a child started in the repository root would
import the unbuilt source tree instead of the installed package.
"""

import os
import subprocess
import sys
import tempfile


def run_python(code, *args, env=None, timeout=120):
    """Run `python -c code args...`; return the CompletedProcess (text output)."""
    return subprocess.run([sys.executable, "-c", code, *map(str, args)],
                          cwd=tempfile.gettempdir(), capture_output=True, text=True,
                          timeout=timeout, env=None if env is None else {**os.environ, **env})
