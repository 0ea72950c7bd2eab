"""Fixtures of the tools' tests."""
import pytest

from linvit_mm.staged import InProcessTools


@pytest.fixture
def in_process_run_tool():
    """A stand-in for ``tools/demo.py``'s ``run_tool`` that runs tools/train.py, tools/test.py
    and the model converters in this process (the recipe benchmark's ``--in-process`` runner):
    the demo's code path less an interpreter start-up per run."""
    return InProcessTools()
