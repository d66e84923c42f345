"""Packaging for mim and for other projects' configs, in the working tree.

mim (``mim train mmfsdp CONFIG``) runs ``<package>/.mim/tools/train.py`` and
finds configs under ``<package>/.mim/configs``; mmengine resolves
``_base_ = ['mmfsdp::PATH']`` to ``<package>/.mim/configs/PATH`` after reading
``<package>/.mim/model-index.yml``. These tests check that layout in the working
tree (what an editable install serves).
"""
import os

import yaml

from harness import REPO

MIM = REPO / 'mmfsdp' / '.mim'


def _top_level_configs() -> set:
    return {f'configs/{p.name}' for p in (REPO / 'configs').glob('*.py')}


def test_mim_folder_links_the_top_level_folders():
    for name in ('configs', 'tools'):
        link = MIM / name
        assert link.is_symlink(), f'{link} must be a symlink (it serves editable installs)'
        assert os.readlink(link) == f'../../{name}', 'the link must be relative to work anywhere'
        assert link.resolve() == (REPO / name).resolve()
    assert (MIM / 'tools' / 'train.py').is_file() and (MIM / 'tools' / 'test.py').is_file()


def test_model_index_lists_every_top_level_config():
    index = yaml.safe_load((MIM / 'model-index.yml').read_text())
    listed = set()
    for meta in index['Import']:
        models = yaml.safe_load((MIM / meta).read_text())['Models']
        listed |= {m['Config'] for m in models}
        assert all({'Name', 'In Collection', 'Config'} <= set(m) for m in models)
    assert listed == _top_level_configs()
