"""Fixtures of the tools' tests."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def in_process_run_tool():
    """A stand-in for ``tools/demo.py``'s ``run_tool`` that runs tools/train.py, tools/test.py
    and the model converters in this process (the recipe benchmark's ``--in-process`` runner):
    the demo's code path less an interpreter start-up per run."""
    spec = importlib.util.spec_from_file_location(
        'linvit_tool_benchmark_recipes', REPO / 'tools/analysis_tools/benchmark_recipes.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.InProcessTools()
