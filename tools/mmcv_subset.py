"""Trim an unpacked mmcv source tree to the C++ ops a project reaches.

mmcv compiles every op of its ``mmcv/ops/csrc`` into one extension, ``mmcv._ext``: 77 C++
files on a CPU build, most of them ops for 3-D point clouds, rotated boxes or sparse
convolutions. An op here is the stem shared by its dispatcher (``csrc/pytorch/<op>.cpp``) and
its CPU implementation (``csrc/pytorch/cpu/<op>.cpp``). Trimming:

- deletes the sources of every op not kept (``setup.py`` collects sources by glob, so a
  deleted file is simply not compiled);
- rewrites ``csrc/pytorch/pybind.cpp`` to declare and bind only the functions that the kept
  dispatchers define (a binding of a function that is not compiled would not link);
- makes ``mmcv.utils.ext_loader.load_ext`` accept an extension without some functions: every
  ``mmcv.ops`` module still imports, and calling an op that was left out raises an error that
  names it and says how to build the full set;
- trims the CUDA sources alike: the ``.cu`` files of the ops not kept are deleted and
  ``csrc/pytorch/cuda/cudabind.cpp``, which registers every op's CUDA launchers, keeps the
  registrations of the kept dispatchers and what they name.

Only the standard library is used: ``tools/setup_env.py`` runs this before the environment has
anything installed.
"""
import re
import sys
from pathlib import Path

# Always kept: mmcv's own version queries (``get_compiler_version``, ...) live in info.cpp.
ALWAYS_KEPT = ('info', )
PYBIND = Path('mmcv/ops/csrc/pytorch/pybind.cpp')
EXT_LOADER = Path('mmcv/utils/ext_loader.py')

_LOAD_EXT_STRICT = """\
    def load_ext(name, funcs):
        ext = importlib.import_module('mmcv.' + name)
        for fun in funcs:
            assert hasattr(ext, fun), f'{fun} miss in module {name}'
        return ext
"""

_LOAD_EXT_PARTIAL = """\
    class _ExtWithoutSomeOps:
        \"\"\"The compiled extension of a build that left out some ops.\"\"\"

        def __init__(self, ext, name, missing):
            self._ext, self._name, self._missing = ext, name, frozenset(missing)

        def __getattr__(self, attr):
            if attr in self._missing:
                raise NotImplementedError(
                    f'mmcv.{self._name}.{attr} was not compiled: this mmcv was built with '
                    'only the ops linvit_mm uses. Build the full set with '
                    'LINVIT_MMCV_OPS=all bash tools/setup_env.sh (see docs/environment.md).')
            return getattr(self._ext, attr)

    def load_ext(name, funcs):
        ext = importlib.import_module('mmcv.' + name)
        missing = [fun for fun in funcs if not hasattr(ext, fun)]
        return _ExtWithoutSomeOps(ext, name, missing) if missing else ext
"""


class TrimError(RuntimeError):
    """The source tree does not look like the one this trimming was written for."""


def available_ops(src):
    """Every op of the tree: the stems of ``csrc/pytorch/*.cpp`` except the binding file."""
    pytorch = Path(src) / PYBIND.parent
    return sorted(p.stem for p in pytorch.glob('*.cpp') if p.name != PYBIND.name)


def split_statements(text):
    """Split C++ text into top-level statements ending in ``;`` or a ``{...}`` body.

    Comments, preprocessor lines and string literals are kept inside the statement that
    follows them; only ``;`` at bracket depth 0 and closing braces back to depth 0 end one.
    """
    statements, start, depth, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if text.startswith('//', i):
            i = text.find('\n', i)
            i = len(text) if i < 0 else i
            continue
        if text.startswith('/*', i):
            end = text.find('*/', i + 2)
            i = len(text) if end < 0 else end + 2
            continue
        if ch == '"':
            i += 1
            while i < len(text) and text[i] != '"':
                i += 2 if text[i] == '\\' else 1
        elif ch == '#' and depth == 0 and text[text.rfind('\n', 0, i) + 1:i].strip() == '':
            end = text.find('\n', i)
            i = len(text) if end < 0 else end
            statements.append(text[start:i + 1])
            start = i + 1
        elif ch in '({[':
            depth += 1
        elif ch in ')}]':
            depth -= 1
            if depth < 0:
                raise TrimError(f'unbalanced {ch!r} at offset {i}')
            if ch == '}' and depth == 0:
                statements.append(text[start:i + 1])
                start = i + 1
        elif ch == ';' and depth == 0:
            statements.append(text[start:i + 1])
            start = i + 1
        i += 1
    statements.append(text[start:])
    return statements


def defined_functions(source):
    """Names of the functions a C++ file defines at namespace level (a body, not a prototype)."""
    names = set()
    for statement in split_statements(source):
        code = _strip_comments(statement).strip()
        if not code.endswith('}') or code.startswith(('#', 'namespace', 'struct', 'class')):
            continue
        head = code[:code.find('{')] if '{' in code else code
        match = re.search(r'([A-Za-z_]\w*)\s*\([^()]*(?:\([^()]*\)[^()]*)*\)\s*(const\s*)?$',
                          head.strip())
        if match and match.group(1) not in {'if', 'for', 'while', 'switch', 'return'}:
            names.add(match.group(1))
    return names


def _strip_comments(text):
    text = re.sub(r'/\*.*?\*/', '', text, flags=re.S)
    return re.sub(r'//[^\n]*', '', text)


def _declared_name(statement):
    code = _strip_comments(statement).strip()
    match = re.search(r'([A-Za-z_]\w*)\s*\(', code)
    return match.group(1) if match else None


def trim_pybind(text, keep_functions):
    """``pybind.cpp`` with only the prototypes and ``m.def`` bindings of ``keep_functions``."""
    module_at = text.find('PYBIND11_MODULE')
    if module_at < 0:
        raise TrimError(f'{PYBIND} has no PYBIND11_MODULE block')
    open_at = text.find('{', module_at)
    close_at = text.rfind('}')
    prologue, body = text[:module_at], text[open_at + 1:close_at]

    kept_prologue = []
    for statement in split_statements(prologue):
        code = _strip_comments(statement).strip()
        name = _declared_name(statement) if code.endswith(';') else None
        if name is None or name in keep_functions:
            kept_prologue.append(statement)
    kept_body, bound = [], set()
    for statement in split_statements(body):
        match = re.search(r'm\.def\(\s*"(\w+)"\s*,\s*&(\w+)', statement)
        if match is None:
            if _strip_comments(statement).strip():
                raise TrimError(f'{PYBIND}: a statement in the module block is not a '
                                f'plain m.def binding: {statement.strip()[:120]!r}')
            kept_body.append(statement)
        elif match.group(2) in keep_functions:
            kept_body.append(statement)
            bound.add(match.group(2))
    return (''.join(kept_prologue) + text[module_at:open_at + 1] + ''.join(kept_body)
            + text[close_at:]), bound


def _op_of(stem, ops):
    """The op a source file belongs to, from its stem: ``roi_align`` (dispatcher and CPU
    file), ``roi_align_cuda`` / ``upfirdn2d_kernel`` (CUDA), ``bbox_overlaps_cpu`` and
    ``sparse_indice`` (CPU / CUDA parts of an op by prefix), ``stack_ball_query_cuda`` (by
    suffix); None for a file of no op. ``nms_rotated`` is an op of its own, not part of
    ``nms``."""
    for suffix in ('_cuda', '_kernel', '_cpu'):
        if stem.endswith(suffix) and stem[:-len(suffix)] in ops:
            return stem[:-len(suffix)]
    if stem in ops:
        return stem
    base = stem[:-5] if stem.endswith('_cuda') else stem
    candidates = [op for op in ops if base.startswith(op + '_') or base.endswith('_' + op)]
    return max(candidates, key=len) if candidates else None


def trim_registrations(text, keep_functions):
    """``cudabind.cpp`` (one file binding every op's CUDA launchers to its dispatcher) with
    only what the kept dispatchers reach: each ``REGISTER_DEVICE_IMPL(<impl>, CUDA, <fn>)``
    of a kept ``<impl>``, then every declaration or definition those name, transitively."""
    statements = split_statements(text)
    needed = set()
    keep = [False] * len(statements)
    for i, statement in enumerate(statements):
        code = _strip_comments(statement).strip()
        match = re.match(r'REGISTER_DEVICE_IMPL\(\s*(\w+)\s*,\s*\w+\s*,\s*(\w+)\s*\)', code)
        if match:
            if match.group(1) in keep_functions:
                keep[i] = True
                needed |= {match.group(1), match.group(2)}   # the impl's prototype too
        elif code != ';' and (not code or _declared_name(statement) is None):
            keep[i] = True          # includes, typedefs, the file's blank tail
    changed = True
    while changed:
        changed = False
        for i, statement in enumerate(statements):
            if keep[i] or _declared_name(statement) not in needed:
                continue
            keep[i] = changed = True
            needed |= set(re.findall(r'[A-Za-z_]\w*', _strip_comments(statement)))
    return ''.join(s for s, kept in zip(statements, keep) if kept)


def trim_tree(src, keep_ops):
    """Trim the unpacked sdist at ``src`` to ``keep_ops``; return the bound function names.

    Refuses (before changing anything) an op name the tree does not have, so a typo in the
    kept list cannot silently build an extension without the op.
    """
    src = Path(src)
    ops = available_ops(src)
    if not ops:
        raise TrimError(f'{src} has no {PYBIND.parent}/*.cpp: not an mmcv source tree')
    keep = set(keep_ops) | set(ALWAYS_KEPT)
    unknown = sorted(keep - set(ops))
    if unknown:
        raise TrimError(f'mmcv has no op source named {", ".join(unknown)} '
                        f'(it has: {", ".join(ops)})')
    loader = src / EXT_LOADER
    loader_text = loader.read_text()
    if _LOAD_EXT_STRICT not in loader_text:
        raise TrimError(f'{EXT_LOADER} no longer has the load_ext this trimming replaces')

    pytorch = src / PYBIND.parent
    cudabind = pytorch / 'cuda' / 'cudabind.cpp'
    kept_files, dropped_files = [], []
    sources = [*pytorch.glob('*.cpp'), *(pytorch / 'cpu').glob('*.cpp'),
               *(pytorch / 'cuda').glob('*.cu'), *(pytorch / 'cuda').glob('*.cpp')]
    for source in sorted(sources):
        if source in (src / PYBIND, cudabind):
            continue
        (kept_files if _op_of(source.stem, ops) in keep else dropped_files).append(source)
    keep_functions = set()
    for source in kept_files:
        if source.suffix == '.cpp' and source.parent == pytorch:
            keep_functions |= defined_functions(source.read_text())
    dispatchers = {p.stem for p in kept_files if p.parent == pytorch}
    for source in kept_files:
        if source.parent != pytorch:
            keep_functions |= defined_functions(source.read_text())
    pybind_text, bound = trim_pybind((src / PYBIND).read_text(), keep_functions)
    if not bound - defined_functions((pytorch / 'info.cpp').read_text()):
        raise TrimError(f'no binding of {PYBIND} is defined by the kept ops {sorted(dispatchers)}')
    cudabind_text = (trim_registrations(cudabind.read_text(), keep_functions)
                     if cudabind.exists() else None)

    for source in dropped_files:
        source.unlink()
    (src / PYBIND).write_text(pybind_text)
    if cudabind_text is not None:
        cudabind.write_text(cudabind_text)
    loader.write_text(loader_text.replace(_LOAD_EXT_STRICT, _LOAD_EXT_PARTIAL))
    return sorted(bound)


def read_kept_ops(path):
    """The op names of a requirements-style list (``#`` comments, one name per line)."""
    names = []
    for line in Path(path).read_text().splitlines():
        line = line.split('#', 1)[0].strip()
        if line:
            names.append(line)
    return names


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(
        description='Trim an unpacked mmcv source tree to some of its C++ ops, in place, so '
                    'that building it (MMCV_WITH_OPS=1 pip install SRC) compiles only those.')
    parser.add_argument('src', help='the unpacked mmcv sdist or git checkout')
    parser.add_argument('--ops', nargs='+', metavar='OP',
                        help='op names (stems of mmcv/ops/csrc/pytorch/*.cpp); default: the '
                             "list of requirements/mmcv_ops.txt, this project's ops")
    parser.add_argument('--list', action='store_true',
                        help='print the ops the tree has and change nothing')
    args = parser.parse_args(argv)
    if args.list:
        ops = available_ops(Path(args.src))
        if not ops:
            print(f'mmcv_subset: {args.src} has no {PYBIND.parent}/*.cpp: not an mmcv source tree',
                  file=sys.stderr)
            return 2
        print('\n'.join(ops))
        return 0
    ops = args.ops or read_kept_ops(Path(__file__).resolve().parents[1] / 'requirements'
                                    / 'mmcv_ops.txt')
    try:
        bound = trim_tree(args.src, ops)
    except TrimError as err:
        print(f'mmcv_subset: {err}', file=sys.stderr)
        return 2
    print(f'kept {", ".join(sorted(set(ops)))}; the extension binds {len(bound)} functions: '
          f'{", ".join(bound)}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
