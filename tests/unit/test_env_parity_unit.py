"""The unit half of tests/integration/chain/test_env_parity.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

import pytest

from substrax_tasks._remote import hints

# ------------------------------------------------------------------ parity


@pytest.mark.unit
def test_a_failure_names_the_left_out_entries_its_log_mentions_only() -> None:
    job = {"left_out": ["helper.py", "data", "notes.txt", "pkg/util.py"]}
    tail = (
        "ModuleNotFoundError: No module named 'helper'\n"
        "FileNotFoundError: [Errno 2] No such file or directory: 'data/raw.csv'\n"
        "helpers and notes.txt.bak are other names\n"
    )
    said = hints.left_out_hint(job, tail)
    assert said == (
        "the run sees the step's declared inputs only, and helper.py, data are not declared; "
        "declare them in inputs=[...] (in outputs=[...] if the command writes them)"
    )
    assert hints.left_out_hint(job, "KeyError: 'x'\n") is None
    assert hints.left_out_hint({"left_out": []}, tail) is None


