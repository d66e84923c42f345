"""What the README, the docs pages and the docstrings promise names things that exist."""
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
