#!/usr/bin/env python
"""Mutation testing of a few modules against the tests chosen for them.

Each mutant is one small fault put into the source (``<`` made ``<=``, a constant changed,
a call deleted, ...). The module's tests run against it; a mutant the tests still pass
("survivor") is a fault they would not catch. The survivors are the output that matters:
each is a line of the module whose behaviour no test pins down.

**Why not mutmut or cosmic-ray.** mutmut 3 copies the source tree into a ``mutants/``
directory, rewrites every function into a trampoline (only code inside functions is
mutated), runs the test selection of the project's config (``tests/`` unless set) once
to record which tests reach which function, and forks one worker per CPU. cosmic-ray
keeps its mutants in a session database (``cosmic-ray init``, then ``exec`` through a
distributor of workers), with one test command per session from its config. Here the
machine has two cores shared by several people, importing the package pulls in torch and
OpenMMLab, and the tests of a module are a handful of files chosen for it: what is wanted
is one module, the tests named on the command line, one pytest at a time, no copy of the
tree and no state beyond a JSON file.

**Mutants**, read from the module's ``ast`` and applied by replacing the exact source span
of the node (or of the operator token), so that the rest of the file stays byte-identical:

- ``arithmetic``: ``+`` <-> ``-``, ``*`` <-> ``/``, ``**`` -> ``*`` (augmented
  assignments too: ``+=`` <-> ``-=``, ...), not where an operand is a string literal;
- ``comparison``: ``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``;
- ``boolean-op``: ``and`` <-> ``or`` (every operator of the one expression);
- ``not``: ``not x`` -> ``x``; ``negation``: ``-x`` -> ``x``;
- ``number``: an int ``c`` -> ``c + 1`` (``1`` -> ``0``), a float ``x`` -> ``2 * x``
  (``0.0`` -> ``1.0``);
- ``boolean`` / ``keyword``: ``True`` <-> ``False`` (``keyword`` when it is the value of a
  call's keyword argument, ``f(x, flag=True)``);
- ``delete-call``: a statement that is a bare call, ``teacher.requires_grad_(False)``, made
  ``pass``.

Not mutated: strings (docstrings included), f-strings, ``raise`` statements and ``assert``
messages, annotations, and ``if __name__ == '__main__':`` blocks (a mutant there would run
the script at import). ``return x`` -> ``return None`` is not a mutant (yet): it would add
many survivors for results no caller reads.

**A run.** The tests run once unmutated (the tool refuses to start if they fail); then,
for each mutant: the module is overwritten with the mutant, ``python -m pytest -x -q
<tests>`` runs in a subprocess with ``--timeout`` seconds (default three times the
baseline's time, at least 10 s; a run killed for time counts as killed, but is reported as
``timeout``), and the original bytes are written back, in a ``finally``, also on Ctrl-C
and SIGTERM. The test runs do not write bytecode, each mutant gets its own modification
time and the original's is restored, so that no later import, ours or anyone's, can take
a cached ``.pyc`` of a mutant for the module. While a run is on, a copy of each module
and a manifest sit in ``<out>.backup/`` beside the JSON output; a run that finds them
refuses to start (the previous one was killed before it could restore): ``--restore`` puts
the copies back.

Do not run it on a module someone is editing, nor two runs on one module: the module is
mutated in place. The JSON output (``--out``, rewritten after every mutant) lists every
mutant with its status, the test that killed it and the time it took; ``--list`` only
lists the mutants.

Example::

    python tools/analysis_tools/mutation_test.py linvit_mm/utils/complexity.py \\
        --tests tests/utils/test_complexity.py --functions attention_macs \\
        --out work_dirs/mutation/complexity.json
"""
import argparse
import ast
import bisect
import contextlib
import hashlib
import io
import json
import os
import re
import select as io_select  # the name select is the mutant selection below
import signal
import subprocess
import sys
import time
import tokenize
from dataclasses import asdict, dataclass, field
from pathlib import Path

ARITHMETIC = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
              ast.Pow: ast.Mult}
COMPARISON = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
              ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
SYMBOL = {ast.Add: '+', ast.Sub: '-', ast.Mult: '*', ast.Div: '/', ast.Pow: '**',
          ast.Lt: '<', ast.LtE: '<=', ast.Gt: '>', ast.GtE: '>=', ast.Eq: '==',
          ast.NotEq: '!=', ast.And: 'and', ast.Or: 'or'}
SKIPPED_FIELDS = ('annotation', 'returns')  # annotations do not run
DISPLAY_LIMIT = 160
DEFAULT_OUT = 'work_dirs/mutation_test/results.json'
MANIFEST = 'manifest.json'


@dataclass
class Mutant:
    file: str
    line: int
    col: int
    kind: str
    original: str  # the enclosing expression or statement, for display
    mutant: str
    scope: str  # the enclosing def/class names, dotted
    edits: list = field(repr=False)  # [(start, end, text)] in characters of the source
    status: str = 'pending'
    seconds: float = 0.0
    killed_by: str = ''

    def describe(self):
        return f'{self.file}:{self.line}: {clip(self.original)} -> {clip(self.mutant)}'

    def record(self):
        out = asdict(self)
        del out['edits']
        return out


def clip(text):
    return text if len(text) <= DISPLAY_LIMIT else text[:DISPLAY_LIMIT - 3] + '...'


# ---------------------------------------------------------------------------- source maps
class Source:
    """A module's text with the maps between ast positions (line, UTF-8 byte column),
    character offsets and tokens."""

    def __init__(self, path, data):
        self.path = path
        self.data = data
        self.text = data.decode('utf-8')
        if re.search('\r(?!\n)', self.text):
            # ast and tokenize disagree on lone carriage returns as line ends
            raise ValueError(f'{path}: lone carriage returns as line ends are not supported')
        # split where tokenize does (str.splitlines also splits at form feeds)
        self.lines = re.findall(r'[^\n]*\n|[^\n]+$', self.text)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))
        self.tree = ast.parse(self.text, filename=str(path))
        self.tokens = []  # (start, end, string) of OP and NAME tokens
        for tok in tokenize.tokenize(io.BytesIO(data).readline):
            if tok.type in (tokenize.OP, tokenize.NAME):
                self.tokens.append((self.offset_chars(*tok.start), self.offset_chars(*tok.end),
                                    tok.string))
        self.token_starts = [t[0] for t in self.tokens]

    def offset_chars(self, lineno, col):
        return self.starts[lineno - 1] + col

    def offset(self, lineno, col_bytes):
        line = self.lines[lineno - 1] if lineno <= len(self.lines) else ''
        if not line.isascii():
            col_bytes = len(line.encode('utf-8')[:col_bytes].decode('utf-8'))
        return self.starts[lineno - 1] + col_bytes

    def span(self, node):
        return (self.offset(node.lineno, node.col_offset),
                self.offset(node.end_lineno, node.end_col_offset))

    def tokens_between(self, start, end, strings):
        i = bisect.bisect_left(self.token_starts, start)
        found = []
        while i < len(self.tokens) and self.tokens[i][0] < end:
            if self.tokens[i][1] <= end and self.tokens[i][2] in strings:
                found.append(self.tokens[i])
            i += 1
        return found

    def token_at(self, start):
        i = bisect.bisect_left(self.token_starts, start)
        return i if i < len(self.tokens) and self.tokens[i][0] == start else None


def apply_edits(text, edits, base=0):
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start - base] + new + text[end - base:]
    return text


def is_main_guard(node):
    test = node.test
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == '__name__')


# ----------------------------------------------------------------------------- generation
class Generator:
    def __init__(self, source, display_path):
        self.src = source
        self.file = display_path
        self.mutants = []

    def run(self):
        self.walk(self.src.tree, [], [])
        return self.mutants

    def walk(self, node, parents, scope):
        if isinstance(node, (ast.Raise, ast.JoinedStr)):
            return
        if isinstance(node, ast.If) and is_main_guard(node):
            for child in node.orelse:
                self.walk(child, parents + [node], scope)
            return
        self.visit(node, parents, scope)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + [node.name]
        for name, value in ast.iter_fields(node):
            if name in SKIPPED_FIELDS or (isinstance(node, ast.Assert) and name == 'msg'):
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    self.walk(child, parents + [node], scope)

    def add(self, node, kind, edits, display, scope, stmt=False):
        src = self.src
        start, end = src.span(display)
        original = src.text[start:end]
        mutated = apply_edits(original, edits, base=start)
        self.mutants.append(Mutant(
            file=self.file, line=node.lineno, col=node.col_offset, kind=kind,
            original=normalise(original, stmt), mutant=normalise(mutated, stmt),
            scope='.'.join(scope), edits=list(edits)))

    def op_edit(self, left, right, old, new):
        """The edit turning the operator token ``old`` between two nodes into ``new``."""
        start, end = self.src.span(left)[1], self.src.span(right)[0]
        found = self.src.tokens_between(start, end, {old})
        if len(found) != 1:
            raise ValueError(f'{self.file}:{left.lineno}: no single {old!r} token found')
        return (found[0][0], found[0][1], new)

    def visit(self, node, parents, scope):
        parent = parents[-1] if parents else None
        if (isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC
                and not (is_text(node.left) or is_text(node.right))):
            old, new = SYMBOL[type(node.op)], SYMBOL[ARITHMETIC[type(node.op)]]
            self.add(node, 'arithmetic', [self.op_edit(node.left, node.right, old, new)],
                     node, scope)
        elif isinstance(node, ast.AugAssign) and type(node.op) in ARITHMETIC:
            old, new = SYMBOL[type(node.op)] + '=', SYMBOL[ARITHMETIC[type(node.op)]] + '='
            self.add(node, 'arithmetic', [self.op_edit(node.target, node.value, old, new)],
                     node, scope, stmt=True)
        elif isinstance(node, ast.Compare):
            lefts = [node.left] + node.comparators[:-1]
            for left, op, right in zip(lefts, node.ops, node.comparators):
                if type(op) in COMPARISON:
                    edit = self.op_edit(left, right, SYMBOL[type(op)],
                                        SYMBOL[COMPARISON[type(op)]])
                    self.add(node, 'comparison', [edit], node, scope)
        elif isinstance(node, ast.BoolOp):
            old = SYMBOL[type(node.op)]
            new = 'or' if old == 'and' else 'and'
            edits = [self.op_edit(a, b, old, new) for a, b in zip(node.values, node.values[1:])]
            self.add(node, 'boolean-op', edits, node, scope)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            # drop the operator token and the blanks after it, keeping any parentheses
            i = self.src.token_at(self.src.span(node)[0])
            symbol = 'not' if isinstance(node.op, ast.Not) else '-'
            if (i is not None and i + 1 < len(self.src.tokens)
                    and self.src.tokens[i][2] == symbol):
                edit = (self.src.tokens[i][0], self.src.tokens[i + 1][0], '')
                kind = 'not' if isinstance(node.op, ast.Not) else 'negation'
                self.add(node, kind, [edit], node, scope)
        elif isinstance(node, ast.Constant) and type(node.value) is bool:
            start, end = self.src.span(node)
            edit = (start, end, str(not node.value))
            if isinstance(parent, ast.keyword):
                self.add(node, 'keyword', [edit], parent, scope)
            else:
                self.add(node, 'boolean', [edit], display_parent(node, parent), scope)
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
            value = node.value
            if type(value) is int:
                new = 0 if value == 1 else value + 1
            elif value != value or value in (float('inf'), float('-inf')):
                return
            else:
                new = 2 * value if value else 1.0
            start, end = self.src.span(node)
            self.add(node, 'number', [(start, end, repr(new))],
                     display_parent(node, parent), scope)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            start, end = self.src.span(node)
            self.add(node, 'delete-call', [(start, end, 'pass')], node, scope, stmt=True)


def is_text(node):
    """A string literal or f-string: ``+`` or ``*`` on it joins or repeats text."""
    return (isinstance(node, ast.JoinedStr)
            or isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)))


def display_parent(node, parent):
    """A constant is shown with its enclosing expression when that is short."""
    if isinstance(parent, ast.expr) and len(ast.unparse(parent)) <= 80:
        return parent
    return node


def normalise(text, stmt):
    """One line of canonical source for display (falls back to the text, blanks folded)."""
    try:
        if stmt:
            return ast.unparse(ast.parse(text))
        return ast.unparse(ast.parse('(\n' + text + '\n)', mode='eval'))
    except SyntaxError:
        return ' '.join(text.split())


def generate(path, data=None, display_path=None):
    """The mutants of one module, in source order, each applying cleanly and differing from
    the original code (not only in its text)."""
    data = Path(path).read_bytes() if data is None else data
    source = Source(path, data)
    original_dump = ast.dump(source.tree)
    mutants, seen = [], set()
    for mutant in Generator(source, str(display_path or path)).run():
        text = apply_edits(source.text, mutant.edits)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        dump = ast.dump(tree)
        if dump == original_dump or dump in seen:
            continue
        seen.add(dump)
        mutants.append(mutant)
    mutants.sort(key=lambda m: (min(e[0] for e in m.edits), m.kind))
    return mutants


def mutated_bytes(data, mutant):
    return apply_edits(data.decode('utf-8'), mutant.edits).encode('utf-8')


def parse_lines(specs):
    ranges = []
    for spec in specs or ():
        match = re.fullmatch(r'(\d+)(?:-(\d+))?', spec)
        if not match:
            raise argparse.ArgumentTypeError(f'--lines takes A-B or A, got {spec!r}')
        a = int(match.group(1))
        ranges.append((a, int(match.group(2) or a)))
    return ranges


def select(mutants, lines=None, functions=None, max_mutants=None):
    """Mutants on the given line ranges and inside the given defs or classes (a bare name
    or dotted path), then at most ``max_mutants`` of them spread evenly over the rest."""
    if lines:
        mutants = [m for m in mutants if any(a <= m.line <= b for a, b in lines)]
    if functions:
        def inside(m):
            parts = m.scope.split('.') if m.scope else []
            return any(f in parts or m.scope == f or m.scope.endswith('.' + f)
                       or m.scope.startswith(f + '.') for f in functions)
        mutants = [m for m in mutants if inside(m)]
    if max_mutants is not None and len(mutants) > max_mutants:
        step = len(mutants) / max_mutants
        mutants = [mutants[int(i * step)] for i in range(max_mutants)]
    return mutants


# -------------------------------------------------------------------------------- running
def run_tests(tests, timeout, cwd=None):
    """pytest over ``tests`` in a fresh interpreter: (status, seconds, output), status one
    of ``passed``, ``failed`` or ``timeout``. The child gets its own process group, so that
    a timeout or an interrupt kills it and whatever it started."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE='1')
    cmd = [sys.executable, '-m', 'pytest', '-x', '-q', '-p', 'no:cacheprovider', '-rfE',
           *map(str, tests)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        status = 'passed' if proc.returncode == 0 else 'failed'
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        status = 'timeout'
    except BaseException:
        kill_group(proc)
        proc.wait()
        raise
    return status, time.perf_counter() - t0, out.decode('utf-8', 'replace')


def run_tests_forked(tests, timeout, cwd=None):
    """As :func:`run_tests`, in a child forked from this process instead of a fresh
    interpreter (``--preload``): the dependencies this process imported once (torch,
    OpenMMLab) are not imported again for every mutant, which on a loaded two-core machine
    is most of a mutant's time. The child imports the project and its tests from disk, so
    it sees the mutant; :func:`preload` refuses to import anything under mutation."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: a pytest run, then _exit (no parent cleanup runs twice)
        code = 3
        try:
            os.setsid()
            os.close(read_fd)
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
            # this process's sys.stdout may be another capture (pytest's, an IDE's)
            sys.stdout = open(1, 'w', buffering=1, closefd=False)
            sys.stderr = open(2, 'w', buffering=1, closefd=False)
            if cwd is not None:
                os.chdir(cwd)
            # what `python -m pytest` puts first: the working directory's packages
            sys.path.insert(0, os.getcwd())
            sys.dont_write_bytecode = True
            import pytest
            code = int(pytest.main(['-x', '-q', '-p', 'no:cacheprovider', '-rfE',
                                    *map(str, tests)]))
        except BaseException:  # noqa: B902  (anything: the parent must get an exit code)
            import traceback
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(write_fd)
    chunks, status = [], None
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        with os.fdopen(read_fd, 'rb') as pipe:
            os.set_blocking(pipe.fileno(), False)
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    status = 'timeout'
                    break
                ready, _, _ = io_select.select([pipe], [], [], left)
                if ready:
                    data = pipe.read()
                    if not data:
                        break  # EOF: the child is done
                    chunks.append(data)
    except BaseException:
        _kill_forked(pid)
        raise
    if status == 'timeout':
        _kill_forked(pid)
    else:
        _, wait_status = os.waitpid(pid, 0)
        status = 'passed' if os.waitstatus_to_exitcode(wait_status) == 0 else 'failed'
    return status, time.perf_counter() - t0, b''.join(chunks).decode('utf-8', 'replace')


def _kill_forked(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(pid, 0)


def preload(names, modules):
    """Imports ``names`` into this process for :func:`run_tests_forked`; refuses when that
    imported one of the ``modules`` under mutation (a forked child would keep the original
    instead of reading the mutant)."""
    import importlib
    for name in names:
        importlib.import_module(name)
    mutated = {Path(m).resolve() for m in modules}
    loaded = sorted(name for name, module in list(sys.modules.items())
                    if getattr(module, '__file__', None)
                    and Path(module.__file__).resolve() in mutated)
    if loaded:
        raise RefusedError(f'--preload {" ".join(names)} imports the module(s) under mutation '
                           f'({", ".join(loaded)}); preload only what they depend on')


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def first_failure(output):
    for line in output.splitlines():
        if line.startswith(('FAILED ', 'ERROR ')):
            return line.split(' ', 1)[1].split(' - ')[0].strip()
    return ''


def sha256(data):
    return hashlib.sha256(data).hexdigest()


class Backup:
    """Copies of the modules under mutation, for a run killed before it could restore."""

    def __init__(self, directory):
        self.dir = Path(directory)
        self.manifest = self.dir / MANIFEST

    def stale(self):
        return self.manifest.exists()

    def write(self, originals):
        self.dir.mkdir(parents=True, exist_ok=True)
        entries = []
        for i, (path, (data, _)) in enumerate(originals.items()):
            copy = self.dir / f'{i}_{Path(path).name}.orig'
            copy.write_bytes(data)
            entries.append(dict(path=str(Path(path).resolve()), copy=copy.name,
                                sha256=sha256(data)))
        self.manifest.write_text(json.dumps(entries, indent=1))

    def remove(self):
        if not self.manifest.exists():
            return
        for entry in json.loads(self.manifest.read_text()):
            (self.dir / entry['copy']).unlink(missing_ok=True)
        self.manifest.unlink()
        try:
            self.dir.rmdir()
        except OSError:
            pass

    def restore(self):
        """Puts back every copy whose module differs from it; returns the restored paths."""
        restored = []
        for entry in json.loads(self.manifest.read_text()):
            data = (self.dir / entry['copy']).read_bytes()
            if sha256(data) != entry['sha256']:
                raise RuntimeError(f'backup {entry["copy"]} is damaged; restore by hand '
                                   f'(e.g. git checkout {entry["path"]})')
            target = Path(entry['path'])
            if not target.exists() or target.read_bytes() != data:
                target.write_bytes(data)
                restored.append(str(target))
        self.remove()
        return restored


def write_module(path, data, mtime_ns, atime_ns):
    with open(path, 'wb') as f:
        f.write(data)
    os.utime(path, ns=(atime_ns, mtime_ns))


class MutationRun:
    def __init__(self, modules, tests, out, timeout=None, cwd=None, log=print, forked=False):
        self.modules = [Path(m) for m in modules]
        self.run_tests = run_tests_forked if forked else run_tests
        self.tests = list(tests)
        self.out = Path(out)
        self.backup = Backup(self.out.with_name(self.out.name + '.backup'))
        self.timeout = timeout
        self.cwd = cwd
        self.log = log
        self.baseline_seconds = None
        self.mutants = []
        self.total_generated = 0
        self._last_stamp = 0

    def _stamp(self, original_mtime_ns):
        """A modification time of its own for each mutant, other than the original's: a
        bytecode cache is keyed by (mtime in whole seconds, size), and many mutants have the
        original's size."""
        stamp = max(int(time.time()), self._last_stamp + 1)
        if stamp == original_mtime_ns // 10**9:
            stamp += 1
        self._last_stamp = stamp
        return stamp * 10**9

    def results(self):
        counts = {key: sum(m.status == status for m in self.mutants) for key, status in
                  (('killed', 'killed'), ('timeouts', 'timeout'), ('survived', 'survived'),
                   ('pending', 'pending'))}
        done = counts['killed'] + counts['timeouts'] + counts['survived']
        score = (counts['killed'] + counts['timeouts']) / done if done else None
        return dict(modules=[str(m) for m in self.modules], tests=self.tests,
                    baseline_seconds=self.baseline_seconds, timeout_seconds=self.timeout,
                    generated=self.total_generated, mutants=len(self.mutants),
                    **counts, score=score,
                    survivors=[m.describe() for m in self.mutants if m.status == 'survived'],
                    results=[m.record() for m in self.mutants])

    def save(self):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results(), indent=1))

    def run(self, mutants):
        """Baseline, then every mutant; the modules are restored whatever happens."""
        self.mutants = mutants
        if self.backup.stale():
            raise RefusedError(
                f'{self.backup.dir} holds the backup of a run that did not finish: check the '
                f'modules with git diff, then rerun with --restore (puts the copies back) '
                f'or delete that directory')
        status, seconds, output = self.run_tests(self.tests, None, self.cwd)
        if status != 'passed':
            raise RefusedError('the tests fail without any mutant; fix them first:\n'
                               + '\n'.join(output.splitlines()[-30:]))
        self.baseline_seconds = round(seconds, 2)
        if self.timeout is None:
            self.timeout = max(10.0, round(3 * seconds, 1))
        self.log(f'baseline passed in {seconds:.1f} s; timeout per mutant {self.timeout} s; '
                 f'{len(mutants)} mutants')
        originals = {}
        for path in self.modules:
            st = path.stat()
            originals[path] = (path.read_bytes(), (st.st_mtime_ns, st.st_atime_ns))
        self.backup.write(originals)
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _terminate)
        try:
            for i, mutant in enumerate(mutants, 1):
                path = Path(mutant.file)
                data, (mtime, atime) = originals[path]
                if path.read_bytes() != data:
                    raise RefusedError(f'{path} changed on disk during the run; stopping')
                try:
                    write_module(path, mutated_bytes(data, mutant), self._stamp(mtime), atime)
                    status, seconds, output = self.run_tests(self.tests, self.timeout, self.cwd)
                finally:
                    with signals_held():
                        write_module(path, data, mtime, atime)
                mutant.status = dict(passed='survived', failed='killed').get(status, status)
                mutant.seconds = round(seconds, 2)
                mutant.killed_by = first_failure(output) if status == 'failed' else ''
                self.log(f'[{i}/{len(mutants)}] {mutant.file}:{mutant.line} {mutant.kind}: '
                         f'{mutant.status} ({seconds:.1f} s)')
                self.save()
        finally:
            signal.signal(signal.SIGTERM, previous)
            intact = True
            with signals_held():
                for path, (data, (mtime, atime)) in originals.items():
                    if path.read_bytes() != data:
                        write_module(path, data, mtime, atime)
                    intact &= path.read_bytes() == data
            if intact:
                self.backup.remove()
            else:  # leave the copies for --restore
                self.log(f'could not restore the modules; the copies are in {self.backup.dir}')
            self.save()
        return self.results()


class RefusedError(RuntimeError):
    pass


@contextlib.contextmanager
def signals_held():
    """Ctrl-C and SIGTERM wait until the block is done (a module half written back)."""
    held = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def _terminate(signum, frame):
    # leaves through the finally blocks that restore the modules
    raise SystemExit(128 + signum)


def summary(results):
    lines = [f'mutants: {results["mutants"]} (of {results["generated"]} generated)',
             f'killed: {results["killed"]}', f'timeouts: {results["timeouts"]} (count as killed)',
             f'survived: {results["survived"]}']
    if results['pending']:
        lines.append(f'not run: {results["pending"]}')
    score = results['score']
    lines.append('score: ' + ('n/a' if score is None else f'{100 * score:.1f}%'))
    if results['survivors']:
        lines.append('survivors:')
        lines.extend('  ' + s for s in results['survivors'])
    return '\n'.join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Mutation testing of modules against their own tests.')
    parser.add_argument('modules', nargs='*', metavar='MODULE.py')
    parser.add_argument('--tests', nargs='+', default=[],
                        help='test files, directories or node ids passed to pytest')
    parser.add_argument('--lines', nargs='+', metavar='A-B',
                        help='only mutants starting on these lines (of every module)')
    parser.add_argument('--functions', nargs='+', metavar='NAME',
                        help='only mutants inside these functions or classes')
    parser.add_argument('--timeout', type=float,
                        help='seconds per mutant (default: 3x the baseline, at least 10)')
    parser.add_argument('--max-mutants', type=int, help='at most N, spread over the rest')
    parser.add_argument('--out', default=DEFAULT_OUT, help='JSON results (default %(default)s)')
    parser.add_argument('--preload', nargs='+', metavar='PACKAGE',
                        help='import these once (e.g. torch mmengine mmpretrain) and fork each '
                             'test run from this process instead of starting a new one')
    parser.add_argument('--list', action='store_true', help='list the mutants, run nothing')
    parser.add_argument('--restore', action='store_true',
                        help='put back the modules from the backup of an unfinished run')
    args = parser.parse_args(argv)
    args.lines = parse_lines(args.lines)
    if not args.restore and not args.modules:
        parser.error('give at least one MODULE.py')
    if not args.restore and not args.list and not args.tests:
        parser.error('--tests is required')
    return args


def main(argv=None, cwd=None):
    args = parse_args(argv)
    out = Path(args.out)
    if args.restore:
        backup = Backup(out.with_name(out.name + '.backup'))
        if not backup.stale():
            print(f'no backup in {backup.dir}')
            return 0
        restored = backup.restore()
        print('restored: ' + (', '.join(restored) if restored else 'nothing (all intact)'))
        return 0
    generated = []
    for module in args.modules:
        generated.extend(generate(module))
    mutants = select(generated, args.lines, args.functions, args.max_mutants)
    if args.list:
        for m in mutants:
            print(f'{m.kind:12s} {m.describe()}')
        return 0
    if not mutants:
        print('no mutants to run (check --lines / --functions)', file=sys.stderr)
        return 2
    run = MutationRun(args.modules, args.tests, out, args.timeout, cwd,
                      forked=bool(args.preload))
    run.total_generated = len(generated)
    try:
        if args.preload:
            preload(args.preload, args.modules)
        results = run.run(mutants)
    except RefusedError as e:
        print(f'refused: {e}', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f'interrupted; the modules are restored; partial results in {out}',
              file=sys.stderr)
        return 130
    print(summary(results))
    print(f'results: {out}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
