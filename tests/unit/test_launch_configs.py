"""The Python-style configs (``configs/py/``, mmengine's ``read_base``) equal the classic ones.

Every classic config ``configs/X/name-with-dashes.py`` has a twin
``configs/py/X/name_with_dashes.py`` (module names cannot hold dashes) and
the other way round. Both are loaded and compared as plain dicts, with each
``type`` reduced to its class or function name: the classic style writes a
registry name (``'mmfsdp.GPT'``, ``'AdamW'``), the Python style imports the
object (``GPT``, ``torch.optim.AdamW``).
"""
from pathlib import Path

import pytest
from mmengine.config import Config
from mmengine.config.lazy import LazyAttr, LazyObject

from harness import REPO

CLASSIC = REPO / 'configs'
PYTHON_STYLE = CLASSIC / 'py'
#: Keys whose strings name a registered class or function.
TYPE_KEYS = frozenset({'type', 'runner_type', 'dataset_type', 'layer_cls'})


def _classic_configs() -> list:
    return sorted(p.relative_to(CLASSIC) for p in CLASSIC.rglob('*.py')
                  if PYTHON_STYLE not in p.parents)


def _twin(classic: Path) -> Path:
    return PYTHON_STYLE / classic.parent / classic.name.replace('-', '_')


def _normalise(value, key=None):
    if isinstance(value, dict):
        return {k: _normalise(v, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_normalise(v, key) for v in value)
    if key in TYPE_KEYS:
        name = value if isinstance(value, str) else value.__name__
        return name.rsplit('.', 1)[-1]
    return value


def _unbuilt(value, path=''):
    """Paths of imported objects mmengine leaves unbuilt (those inside lists)."""
    if isinstance(value, dict):
        for key in value:
            yield from _unbuilt(value[key], f'{path}.{key}')  # ConfigDict builds on access
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _unbuilt(item, f'{path}[{i}]')
    elif isinstance(value, (LazyAttr, LazyObject)):
        yield path


def test_every_config_has_a_twin():
    twins = {_twin(c) for c in _classic_configs()}
    python_style = {p for p in PYTHON_STYLE.rglob('*.py')}
    assert python_style == twins, 'add or remove the Python-style twin of a classic config'


@pytest.mark.parametrize('classic', _classic_configs(), ids=str)
def test_python_style_config_equals_classic(classic):
    expected = Config.fromfile(CLASSIC / classic).to_dict()
    cfg = Config.fromfile(_twin(classic))
    assert _normalise(cfg.to_dict()) == _normalise(expected)
    # What the runner reads must be real objects: mmengine builds an imported
    # object when a dict value is read, never inside a list.
    assert not list(_unbuilt(cfg._cfg_dict)), 'write names, not imported objects, in lists'
    # The Python style imports real objects, not names: every type resolves.
    for section in ('model', 'model_wrapper_cfg', 'optim_wrapper', 'val_evaluator'):
        if section in cfg:
            assert not isinstance(cfg[section]['type'], str), section
    if 'train_dataloader' in cfg:
        assert not isinstance(cfg.train_dataloader.dataset['type'], str)
