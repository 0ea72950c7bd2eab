"""What README.md and the guides under docs/ show exists: the files and folders they name, the
relative links and their anchors, each ``tools/...`` command's options in that tool's parser,
the config names, the ``linvit_mm.*`` import paths, the quick-start configs, and the model-zoo
table, which is the metafiles' summary.

Nothing here builds a model or a Runner: the tools' parsers are read in one subprocess that
stops each tool at its ``parse_args``.
"""
import functools
import glob
import importlib
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
README = REPO / 'README.md'
GUIDES = sorted((REPO / 'docs').rglob('*.md'))
CONFIG_READMES = sorted((REPO / 'configs').rglob('README.md'))
DOCS = [README, *GUIDES]
LINKED = [*DOCS, *CONFIG_READMES]

# Top-level entries a doc may name as a path of this repository; anything else (work_dirs/,
# checkpoints/, data/, my_configs/) is what a user makes or downloads.
REPO_ROOTS = ('configs', 'docs', 'linvit_mm', 'tools', 'tests', 'requirements', '.ci')
REPO_FILES = ('setup.py', 'setup.cfg', 'model-index.yml', 'pytest.ini')
# Shell scripts that hand their options on to a Python tool.
LAUNCHERS = {'tools/dist_train.sh': 'tools/train.py', 'tools/slurm_train.sh': 'tools/train.py',
             'tools/dist_test.sh': 'tools/test.py', 'tools/slurm_test.sh': 'tools/test.py'}


def rel(path):
    return path.relative_to(REPO).as_posix()


def ids(paths):
    return [rel(p) for p in paths]


# ----------------------------------------------------------------------------- reading markdown
FENCE = re.compile(r'^```(\w*)\n(.*?)^```', re.M | re.S)


@functools.lru_cache(maxsize=None)
def parts(path):
    """``(code blocks as (language, text), prose with the blocks cut out)`` of a markdown file."""
    text = path.read_text()
    blocks = [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]
    return blocks, FENCE.sub('\n', text)


def inline_code(path):
    return re.findall(r'`([^`\n]+)`', parts(path)[1])


def code_texts(path):
    """Every piece of code a doc shows: its blocks and its inline spans."""
    return [text for _, text in parts(path)[0]] + inline_code(path)


def shell_commands(path):
    """Command lines of the shell blocks (continuations joined) and of the inline spans."""
    lines = []
    for language, text in parts(path)[0]:
        if language in ('shell', 'bash', 'sh', ''):
            lines += text.replace('\\\n', ' ').splitlines()
    lines += inline_code(path)
    commands = []
    for line in lines:
        line = re.split(r'(?:^|\s)#', line)[0]  # a shell comment
        # a pipe has spaces around it; '[--attn-type relu|elu]' lists choices
        commands += [c.strip() for c in re.split(r'&&|\|\||;|\s\|\s', line) if c.strip()]
    return commands


def expand_braces(token):
    """``a-{relu,ttt}-b`` -> ``a-relu-b``, ``a-ttt-b``; a placeholder ``{op}`` becomes ``*``."""
    match = re.search(r'\{([^{}]*)\}', token)
    if not match:
        return [token]
    choices = match.group(1).split(',') if ',' in match.group(1) else ['*']
    return list(itertools.chain.from_iterable(
        expand_braces(token[:match.start()] + choice + token[match.end():])
        for choice in choices))


# ----------------------------------------------------------------------------- files and folders
PATH_TOKEN = re.compile(
    r'(?<![\w./$-])((?:' + '|'.join(re.escape(r) for r in REPO_ROOTS) + r')/[\w./{},*\-]*'
    r'|(?:' + '|'.join(re.escape(f) for f in REPO_FILES) + r'))')


def named_paths(path):
    found = set()
    for text in code_texts(path):
        for token in PATH_TOKEN.findall(text):
            token = token.split('::')[0].rstrip('.,')
            found.update(expand_braces(token))
    return sorted(found)


def exists(token):
    if any(ch in token for ch in '*?['):
        return bool(glob.glob(str(REPO / token)))
    return (REPO / token).exists()


@pytest.mark.parametrize('doc', DOCS, ids=ids(DOCS))
def test_named_files_and_folders_exist(doc):
    missing = [token for token in named_paths(doc) if not exists(token)]
    assert not missing, f'{rel(doc)} names paths that do not exist: {missing}'


# ----------------------------------------------------------------------------- links
LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')


def slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading.strip()).lower()
    text = re.sub(r'[^\w\- ]', '', text.replace('`', ''))
    return text.replace(' ', '-')


@functools.lru_cache(maxsize=None)
def anchors(path):
    seen, result = {}, set()
    for heading in re.findall(r'^#{1,6} (.+)$', parts(path)[1], re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        result.add(base if count == 0 else f'{base}-{count}')
        seen[base] = count + 1
    return result


def broken_links(doc):
    broken = []
    for target in LINK.findall(parts(doc)[1]):
        if re.match(r'[a-z]+:', target):
            continue  # http(s), mailto
        file, _, anchor = target.partition('#')
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f'{target} (no such file)')
        elif anchor and dest.suffix == '.md' and anchor not in anchors(dest):
            broken.append(f'{target} (no heading #{anchor} in {rel(dest)})')
        elif REPO not in dest.parents and dest != REPO:
            broken.append(f'{target} (outside the repository)')
    return broken


@pytest.mark.parametrize('doc', LINKED, ids=ids(LINKED))
def test_relative_links_and_anchors_resolve(doc):
    broken = broken_links(doc)
    assert not broken, f'{rel(doc)}: {broken}'


def test_every_page_under_docs_is_in_the_index():
    index = REPO / 'docs' / 'README.md'
    linked = {(index.parent / target.partition('#')[0]).resolve()
              for target in LINK.findall(parts(index)[1])}
    unlisted = [rel(p) for p in GUIDES if p != index and p.resolve() not in linked]
    assert not unlisted, f'docs/README.md does not list {unlisted}'


def test_doc_paths_named_in_code_and_configs_exist():
    """Docstrings, comments and config files point at guides too; those pages must exist."""
    missing = []
    sources = [*REPO.glob('linvit_mm/**/*.py'), *REPO.glob('tools/**/*.py'),
               *REPO.glob('configs/**/*.py'), *REPO.glob('requirements/*.txt')]
    for source in sources:
        for token in re.findall(r'\bdocs/[\w/.-]+\.md', source.read_text(errors='ignore')):
            if not (REPO / token).is_file():
                missing.append(f'{rel(source)}: {token}')
    assert not missing


# ----------------------------------------------------------------------------- tool options
TOOL = re.compile(r'(?<![\w/.-])(tools/[\w/]+\.(?:py|sh))\b')
OPTION = re.compile(r'(?<![\w-])(--[A-Za-z][\w-]*)')


def tool_options_named(doc):
    """``{tool: {option, ...}}`` for each command of ``doc`` that runs a tool of tools/."""
    named = {}
    for command in shell_commands(doc):
        match = TOOL.search(command)
        if not match:
            continue
        tool = LAUNCHERS.get(match.group(1), match.group(1))
        if not tool.endswith('.py'):
            continue
        options = set(OPTION.findall(command[match.end():]))
        named.setdefault(tool, set()).update(options)
    return named


# Runs each tool as __main__ until its parser parses, then reports the parser's option
# strings (subparsers included) instead of going on.
CAPTURE = r'''
import argparse, json, os, runpy, sys
class Parsed(Exception):
    pass
def options(parser):
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options(sub)
    return found
def stop(self, *args, **kwargs):
    raise Parsed(sorted(options(self)))
argparse.ArgumentParser.parse_args = stop
argparse.ArgumentParser.parse_known_args = stop
result = {}
for tool in sys.argv[1:]:
    environ = dict(os.environ)
    sys.argv = [tool]
    try:
        runpy.run_path(tool, run_name='__main__')
        result[tool] = None
    except Parsed as parsed:
        result[tool] = parsed.args[0]
    finally:
        os.environ.clear()
        os.environ.update(environ)
print('OPTIONS' + json.dumps(result))
'''


@pytest.fixture(scope='module')
def parser_options():
    tools = sorted({tool for doc in DOCS for tool in tool_options_named(doc)
                    if (REPO / tool).is_file()})
    run = subprocess.run([sys.executable, '-c', CAPTURE, *tools], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.rsplit('OPTIONS', 1)[1])


@pytest.mark.parametrize('doc', DOCS, ids=ids(DOCS))
def test_tool_commands_use_options_the_tool_has(doc, parser_options):
    wrong = {}
    for tool, named in tool_options_named(doc).items():
        assert (REPO / tool).is_file(), f'{rel(doc)} runs {tool}, which does not exist'
        known = parser_options[tool]
        assert known is not None, f'{tool} finished without parsing arguments'
        unknown = sorted(named - set(known))
        if unknown:
            wrong[tool] = unknown
    assert not wrong, f'{rel(doc)} gives options the tools do not have: {wrong}'


# ----------------------------------------------------------------------------- config names
CONFIG_NAME = re.compile(
    r'(?<![\w/.{-])((?:mask-rcnn_|upernet_)?linvit-[\w.,{}-]*_[\w.,{}-]+?)(?:\.py)?(?![\w{}.-])')


def config_names(doc):
    names = set()
    for text in code_texts(doc):
        for token in CONFIG_NAME.findall(text):
            if not re.fullmatch(r'[\w{},-]*[a-z0-9}]', token.replace('.', '')) or '..' in token:
                continue  # a pattern of names or an ellipsis, not a name
            names.update(n for n in expand_braces(token) if '*' not in n)
    return sorted(names)


def kept_configs():
    return {p.stem for p in (REPO / 'configs').rglob('*.py')}


def make_config(names, out_dir):
    return subprocess.run([sys.executable, 'tools/misc/make_config.py', *names, '--out-dir',
                           str(out_dir)], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope='module')
def writable_configs(tmp_path_factory):
    """The names the docs give that are not kept configs, and which make_config.py writes."""
    others = sorted({name for doc in DOCS for name in config_names(doc)} - kept_configs())
    out_dir = tmp_path_factory.mktemp('make_config')
    if make_config(others, out_dir).returncode != 0:  # find the names it refused
        for name in others:
            make_config([name], out_dir)
    return {p.stem for p in out_dir.rglob('*.py')}


@pytest.mark.parametrize('doc', DOCS, ids=ids(DOCS))
def test_config_names_are_kept_or_written_by_make_config(doc, writable_configs):
    """A name the docs give is a config under configs/, or one make_config.py writes."""
    unknown = [name for name in config_names(doc)
               if name not in kept_configs() and name not in writable_configs]
    assert not unknown, f'{rel(doc)} names configs that are neither kept nor written by ' \
        f'tools/misc/make_config.py: {unknown}'


# ----------------------------------------------------------------------------- import paths
IMPORT_PATH = re.compile(r'(?<![\w.:])(linvit_mm(?:\.[A-Za-z_]\w*)+)')


def resolves(dotted):
    names = dotted.split('.')
    for cut in range(len(names), 0, -1):
        try:
            obj = importlib.import_module('.'.join(names[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for name in names[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize('doc', DOCS, ids=ids(DOCS))
def test_linvit_mm_import_paths_resolve(doc):
    dotted = sorted({m for text in code_texts(doc) for m in IMPORT_PATH.findall(text)})
    missing = [d for d in dotted if not resolves(d)]
    assert not missing, f'{rel(doc)} names what linvit_mm does not have: {missing}'


# ----------------------------------------------------------------------------- README
def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    # the suite's commands, as CI runs them, and the environment's set-up
    ci = (REPO / '.ci' / 'run').read_text()
    for command in ('.venv/bin/python -m pytest tests', 'bash tools/setup_env.sh'):
        assert command in ci and command in text, command
    assert '-m "not slow"' in text and '-m slow' in text
    assert 'for selection in "not slow" "slow"' in ci


def quick_start_configs():
    return [text for language, text in parts(README)[0]
            if language == 'python' and 'linvit_mm::' in text]


def test_readme_has_a_quick_start_for_each_task():
    bases = [re.search(r"_base_ = 'linvit_mm::(\w+)/", text).group(1)
             for text in quick_start_configs()]
    assert sorted(bases) == ['classification', 'detection', 'segmentation']


@pytest.mark.parametrize('task', ['classification', 'detection', 'segmentation'])
def test_quick_start_config_resolves(task, tmp_path):
    import linvit_mm  # noqa: F401  (makes linvit_mm:: bases resolvable, as our tools do)
    from mmengine import Config
    text, = [text for text in quick_start_configs() if f"'linvit_mm::{task}/" in text]
    path = tmp_path / 'mine.py'
    path.write_text(text)
    cfg = Config.fromfile(str(path))
    for module in cfg.custom_imports['imports']:
        importlib.import_module(module)
    # every key the user's file sets arrives in the resolved config
    overrides = Config.fromstring(re.sub(r'^_base_.*$', '', text, flags=re.M), '.py')
    assert_contains(cfg, overrides.to_dict(), 'cfg')


def assert_contains(actual, expected, where):
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_contains(actual[key], value, f'{where}.{key}')
        else:
            assert actual[key] == value, f'{where}.{key}'


def model_zoo_rows():
    """The README's model-zoo rows, regenerated from model-index.yml and the metafiles."""
    rows = []
    for metafile in yaml.safe_load((REPO / 'model-index.yml').read_text())['Import']:
        data = yaml.safe_load((REPO / metafile).read_text())
        for collection in data['Collections']:
            models = [m for m in data['Models'] if m['In Collection'] == collection['Name']]
            trained_on = collection['Metadata']['Training Data']
            if isinstance(trained_on, list):
                trained_on = ', '.join(trained_on)
            operators = ', '.join(sorted({m['Metadata']['Attention'] for m in models}))
            with_results = sum('Results' in m for m in models)
            folder = str(Path(collection['README']).parent)
            rows.append(f"| {collection['Name']} | {trained_on} | {len(models)} | {operators} "
                        f"| {with_results} | [{folder}]({collection['README']}) |")
    return rows


def test_model_zoo_table_is_the_metafiles_summary():
    text = README.read_text()
    start = text.index('<!-- model-zoo')
    block = text[start:text.index('<!-- /model-zoo -->')]
    table = [line for line in block.splitlines() if line.startswith('|')][2:]  # no header
    expected = model_zoo_rows()
    assert table == expected, 'README.md model-zoo rows should be:\n' + '\n'.join(expected)


def override_rows(text):
    start = text.index('| to get | add |')
    return [line for line in text[start:].split('\n\n')[0].splitlines()[2:]]


def test_readme_override_rows_are_in_the_config_guide():
    guide = (REPO / 'docs' / 'user_guides' / 'config.md').read_text()
    readme_rows, guide_rows = override_rows(README.read_text()), override_rows(guide)
    assert readme_rows and set(readme_rows) <= set(guide_rows)
