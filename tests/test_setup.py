"""The package metadata in setup.py against what the code and its dependencies need."""
import ast
import re
import subprocess
import sys
from importlib.metadata import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def declared_minimum():
    match = re.search(r"python_requires='>=(\d+)\.(\d+)'", (ROOT / 'setup.py').read_text())
    assert match, 'setup.py states no python_requires=">=X.Y"'
    return int(match[1]), int(match[2])


def test_python_requires_is_what_torch_needs():
    torch_minimum = re.fullmatch(r'>=(\d+)\.(\d+)', metadata('torch')['Requires-Python'])
    assert declared_minimum() == (int(torch_minimum[1]), int(torch_minimum[2]))


def test_every_python_file_parses_at_the_declared_minimum():
    files = subprocess.run(['git', 'ls-files', '--cached', '--others', '--exclude-standard',
                            '*.py'], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert any(name.startswith('linvit_mm/') for name in files)
    for name in files:
        path = ROOT / name
        if path.is_file():
            ast.parse(path.read_text(), str(path), feature_version=declared_minimum())
    assert sys.version_info[:2] >= declared_minimum()
