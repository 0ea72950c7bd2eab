"""torch caches a C++ extension by its name: the kernels' name is keyed by their sources and
their place, so two checkouts never build or load each other's kernels."""
import shutil

import pytest

import linvit_mm.ops.extension as extension


@pytest.fixture
def two_copies(tmp_path):
    """Two copies of the kernels' sources in different places, identical for now."""
    copies = []
    for name in ('checkout_a', 'checkout_b'):
        shutil.copytree(extension.CSRC, tmp_path / name / 'csrc')
        copies.append(tmp_path / name / 'csrc')
    return copies


def change_one_constant(csrc):
    # in a header the sources include: it counts as much as a source file
    path = csrc / 'vector_math.h'
    text = path.read_text()
    assert text.count('88.7f') == 1
    path.write_text(text.replace('88.7f', '88.6f'))


def test_each_place_keeps_its_own_build(two_copies):
    # identical sources in two checkouts: two names, so neither rebuilds the other's cache
    a, b = two_copies
    assert extension.extension_name(a) != extension.extension_name(b)
    assert extension.extension_name(a) == extension.extension_name(a)
    assert extension.extension_name(a).startswith('linvit_mm_cpu_kernels_')


def test_one_changed_constant_gives_another_name(two_copies):
    a, _ = two_copies
    before = extension.extension_name(a)
    change_one_constant(a)
    assert extension.extension_name(a) != before


def test_a_new_header_gives_another_name(two_copies):
    a, _ = two_copies
    before = extension.extension_name(a)
    (a / 'common.h').write_text('#pragma once\n')
    assert extension.extension_name(a) != before


def test_files_that_are_not_sources_do_not_count(two_copies):
    a, _ = two_copies
    before = extension.extension_name(a)
    (a / '.ttt_inner.cpp.swp').write_bytes(b'\0')
    (a / 'NOTES.txt').write_text('x')
    assert extension.extension_name(a) == before


def test_vector_width_gives_another_name():
    assert extension.extension_name(capability='AVX2') != \
        extension.extension_name(capability='AVX512')


def test_cpu_kernels_build_under_the_source_keyed_name(monkeypatch):
    monkeypatch.setattr(extension, '_extension', extension._UNLOADED)
    monkeypatch.delenv('LINVIT_MM_CPU_KERNELS', raising=False)
    calls = []
    monkeypatch.setattr('torch.utils.cpp_extension.load',
                        lambda **kwargs: calls.append(kwargs) or 'module')
    assert extension.cpu_kernels() == 'module'
    (call, ) = calls
    assert call['name'] == extension.extension_name(extension.CSRC)
    assert sorted(call['sources']) == sorted(
        str(extension.CSRC) + '/' + name for name in extension.SOURCES)


TAGGED_MODULE = '''#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.attr("tag") = TAG; }
'''


@pytest.mark.slow
def test_two_checkouts_build_and_load_their_own(tmp_path, monkeypatch):
    """Two source trees that differ in one constant, built into one torch extension cache:
    each loads its own module from its own build directory."""
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path / 'cache'))
    trees = []
    for tag in (1, 2):
        csrc = tmp_path / f'checkout_{tag}' / 'csrc'
        csrc.mkdir(parents=True)
        (csrc / 'tag.cpp').write_text(TAGGED_MODULE.replace('TAG', str(tag)))
        trees.append(csrc)
    first, second = (extension.build(csrc, sources=('tag.cpp', )) for csrc in trees)
    assert (first.tag, second.tag) == (1, 2)
    dirs = {m.__file__.rsplit('/', 1)[0] for m in (first, second)}
    assert len(dirs) == 2 and all(d.startswith(str(tmp_path / 'cache')) for d in dirs)
