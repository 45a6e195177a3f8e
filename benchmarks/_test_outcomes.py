"""A pytest plugin for ``device_check.py``: every test's outcome as one JSON line.

Loaded with ``-p _test_outcomes`` (``benchmarks/`` on ``PYTHONPATH``), it
appends a line per test phase that ran (setup, call, teardown) to the file
``$PAGEDKV_TEST_OUTCOMES`` names, as each finishes: a run that the check
stops at its time limit still leaves the outcomes so far.  Under
pytest-xdist only the controller writes (the workers' reports reach it).
"""
import json
import os


def _message(report):
    """What a failure or skip says, kept short (the end of a traceback matters most)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = getattr(report, "longreprtext", "") or ""
    return text[-1500:]


def pytest_runtest_logreport(report):
    path = os.environ.get("PAGEDKV_TEST_OUTCOMES")
    if not path or (report.when != "call" and report.passed):
        return
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "seconds": round(report.duration, 4)}
    if not report.passed:
        line["message"] = _message(report)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


def pytest_configure(config):
    if hasattr(config, "workerinput"):      # an xdist worker: the controller records
        os.environ.pop("PAGEDKV_TEST_OUTCOMES", None)
