"""What the README, the docs pages and the docstrings promise names things that exist."""
import ast
import importlib
import re

import pytest

from harness import REPO

_DOTTED = re.compile(r'\bmmfsdp(?:\.[A-Za-z_][A-Za-z0-9_]*)+')


def _texts():
    yield from (REPO / 'mmfsdp').rglob('*.py')
    yield from (REPO / 'docs').glob('*.md')
    yield REPO / 'README.md'


def _registered(name: str) -> bool:
    """``'mmfsdp.Name'`` as a config's ``type`` names it: in one of mmfsdp's registries."""
    from mmfsdp import registry
    return any(getattr(registry, r).get(name) is not None for r in registry.__all__)


def _resolves(name: str) -> bool:
    if name.count('.') == 1 and _registered(name):
        return True
    parts = name.split('.')
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize('path', sorted(_texts()), ids=lambda p: str(p.relative_to(REPO)))
def test_every_mmfsdp_name_the_text_gives_exists(path):
    names = sorted(set(_DOTTED.findall(path.read_text())) - {'mmfsdp.MyWrapper'})  # an example
    assert [n for n in names if not _resolves(n)] == []


#: ``tests/dist/test_x.py::test_y``, ``test_x.py::test_y`` or ``test_x.py::TestZ::test_y``
#: (a parametrized id after ``[`` is not part of the name).
_TEST_REF = re.compile(r'(?<![\w/])((?:tests/(?:\w+/)*)?test_\w+\.py)::(\w+(?:::\w+)*)')


def _pages():
    return sorted((REPO / 'docs').glob('*.md')) + [REPO / 'README.md']


def _defined(path) -> set:
    """The class and function names a test file defines (what a pytest node id is made of)."""
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@pytest.mark.parametrize('page', _pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_the_text_names_exists(page):
    """A page that names the test holding a promise names a test that is there."""
    files = sorted((REPO / 'tests').rglob('test_*.py'))
    missing = []
    for file, name in _TEST_REF.findall(page.read_text()):
        matches = [f for f in files if f.relative_to(REPO).as_posix() == file or f.name == file]
        if not any(set(name.split('::')) <= _defined(f) for f in matches):
            missing.append(f'{file}::{name}')
    assert missing == []


def test_every_marked_block_of_the_benchmarks_page_is_written_by_a_script():
    """Each ``<!-- begin: NAME -->`` block is one a script in ``benchmarks/`` writes: NAME is a
    string key of a dict there (the scripts hand their blocks to ``records.finish`` as one); a
    table no script refreshes belongs on ``docs/benchmarks-archive.md``."""
    page = (REPO / 'docs' / 'benchmarks.md').read_text()
    begins = re.findall(r'^<!-- begin: (\S+) -->$', page, re.M)
    assert begins and begins == re.findall(r'^<!-- end: (\S+) -->$', page, re.M)
    written = {key.value for path in (REPO / 'benchmarks').rglob('*.py')
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Dict)
               for key in node.keys if isinstance(key, ast.Constant)}
    assert [name for name in begins if name not in written] == []


@pytest.mark.parametrize('page', ['README.md', 'docs/get-started.md'])
def test_the_supported_versions_rows_are_the_tested_versions(page):
    """README and get-started list the torch and mmengine rows :mod:`mmfsdp.compat.version`
    writes (``tested_versions_text``): its ``TESTED_TORCH`` is the one list."""
    from mmfsdp.compat import tested_versions_text
    assert tested_versions_text() in (REPO / page).read_text(), (
        f'{page}: the torch / mmengine rows differ from mmfsdp.compat.tested_versions_text(); '
        'paste its output in place of the two rows')
