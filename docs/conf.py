"""Sphinx configuration of mmfsdp's documentation.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html``
(needs ``pip install -e '.[docs]'``). Pages are Markdown (myst-parser); the API
reference is generated from the docstrings (autodoc, napoleon).
"""
import functools
import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sphinx.pycode import ModuleAnalyzer  # noqa: E402
from sphinx.util import logging  # noqa: E402

import mmfsdp  # noqa: E402

logger = logging.getLogger('mmfsdp.docs')

project = 'mmfsdp'
author = 'mmfsdp contributors'
copyright = 'mmfsdp contributors'  # noqa: A001 (Sphinx's name)
release = mmfsdp.__version__
version = release

extensions = [
    'myst_parser',
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',
    'sphinx.ext.viewcode',
]

source_suffix = {'.md': 'markdown', '.rst': 'restructuredtext'}
root_doc = 'index'
exclude_patterns = ['_build', 'Thumbs.db', '.DS_Store']

myst_enable_extensions = ['colon_fence', 'deflist']
myst_heading_anchors = 4

autodoc_default_options = {'members': True, 'undoc-members': True, 'show-inheritance': True}
autodoc_member_order = 'bysource'
autodoc_typehints = 'description'
autodoc_typehints_format = 'short'
napoleon_google_docstring = True
napoleon_numpy_docstring = False


html_theme = 'furo'
html_title = f'mmfsdp {release}'


# -- the API reference: one page per module, written at start-up ---------------------------
# Written here rather than by autosummary, which takes ``mmfsdp.meta_init.materialize`` (a
# module) for the function of that name the package re-exports.
API_DIR = Path(__file__).resolve().parent / 'api'


def public_modules():
    """``mmfsdp`` and every submodule whose name has no leading underscore."""
    names = ['mmfsdp']
    for info in pkgutil.walk_packages(mmfsdp.__path__, 'mmfsdp.'):
        if not any(part.startswith('_') for part in info.name.split('.')):
            names.append(info.name)
    return sorted(names)


def write_api_pages(app):
    """``docs/api/<module>.rst`` for every public module (the directory is not committed)."""
    API_DIR.mkdir(exist_ok=True)
    wanted = {f'{name}.rst' for name in public_modules()}
    for stale in API_DIR.glob('*.rst'):
        if stale.name not in wanted:
            stale.unlink()
    for name in public_modules():
        text = f'{name}\n{"=" * len(name)}\n\n.. automodule:: {name}\n'
        page = API_DIR / f'{name}.rst'
        if not page.exists() or page.read_text() != text:
            page.write_text(text)


# -- every public name on exactly one page ------------------------------------------------
# A package re-exports names from its submodules (``mmfsdp.FSDPRunner`` is
# ``mmfsdp.runner.FSDPRunner``): a class or function is documented where it is
# defined, and a package page lists what it exports with links there. Objects of
# other packages (``mmfsdp.compat`` re-exports a few of torch's) are named, not
# documented.


def _home(obj):
    """The module a class or function is defined in, else ``None`` (data)."""
    if inspect.isclass(obj) or inspect.isfunction(obj):
        return getattr(obj, '__module__', None)
    return None


@functools.cache
def _documented_data(module_name):
    """The data names autodoc documents on a module's page: those with a ``#:`` comment."""
    module = importlib.import_module(module_name)
    names = {name for (scope, name) in ModuleAnalyzer.for_module(module_name).find_attr_docs()
             if not scope}
    exported = getattr(module, '__all__', None)
    return frozenset(names if exported is None else names & set(exported))


def _data_home(module_name, member):
    """Where the data ``module_name.member`` is documented: ``(target, here)``.

    ``here`` is true when the page of ``module_name`` must document it itself.
    """
    if member in _documented_data(module_name):
        return f'{module_name}.{member}', False
    value = getattr(importlib.import_module(module_name), member)
    for other in public_modules():
        module = importlib.import_module(other)
        for name in _documented_data(other):
            if getattr(module, name, None) is value and (name == member or member.startswith('__')):
                return f'{other}.{name}', False
    return f'{module_name}.{member}', True


def _target(module_name, member):
    """The documented full name of ``module_name.member`` and whether this page writes it."""
    obj = getattr(importlib.import_module(module_name), member)
    home = _home(obj)
    if home is None:
        return _data_home(module_name, member)
    return f'{home}.{obj.__qualname__}', False


def _skip_imported(app, what, name, obj, skip, options):
    """Skip a module member defined in another module: it is documented there."""
    if what != 'module':
        return skip
    home = _home(obj)
    if home is None:
        return skip
    documented = getattr(app, '_mmfsdp_current_module', None)
    return True if home != documented else skip


def _note_module(app, what, name, obj, options, lines):
    """Remember the module being documented; list the names it re-exports."""
    if what != 'module':
        return
    app._mmfsdp_current_module = name
    exported, written, others = [], [], []
    for member in getattr(obj, '__all__', ()):
        value = getattr(obj, member)
        home = _home(value)
        if home is not None and not home.startswith('mmfsdp.'):
            others.append(f'{home}.{value.__qualname__}')
            continue
        target, here = _target(name, member)
        if here:
            written.append(member)
        elif target != f'{name}.{member}':
            doc = inspect.getdoc(value) if home is not None else ''
            summary = ' '.join((doc or '').split('\n\n')[0].split())
            entry = f'- :py:obj:`{member} <{target}>`'
            exported.append(entry + (f': {summary}' if summary else ''))
    if exported:
        lines += ['', '.. rubric:: Exported here, documented where they are defined', '']
        lines += exported + ['']
    for member in written:
        lines += ['', f'.. py:data:: {member}', '']
    if others:
        lines += ['', 'Re-exported from other packages: '
                  + ', '.join(f'``{target}``' for target in others) + '.', '']


def _check_every_public_name(app, env):
    """Warn (an error under ``-W``) for a public name the reference does not document."""
    objects = env.get_domain('py').objects
    missing = []
    for module_name in public_modules():
        if module_name not in objects:
            missing.append(f'module {module_name}')
            continue
        module = importlib.import_module(module_name)
        for member in getattr(module, '__all__', ()):
            home = _home(getattr(module, member))
            if home is not None and not home.startswith('mmfsdp.'):
                continue
            target, _ = _target(module_name, member)
            if target not in objects:
                missing.append(f'{module_name}.{member} ({target})')
    if missing:
        logger.warning('API reference misses public names: %s', ', '.join(missing))


def setup(app):
    """Write the API pages, document each name once, check that none is missing."""
    app.connect('builder-inited', write_api_pages)
    app.connect('autodoc-process-docstring', _note_module)
    app.connect('autodoc-skip-member', _skip_imported)
    app.connect('env-check-consistency', _check_every_public_name)
