"""Packaging for mim and for other projects' configs, in a wheel and from another directory.

A wheel built from the working tree (what a regular install copies) holds
``<package>/.mim/configs`` and ``tools``; a config in another directory inherits
ours through ``_base_ = ['mmfsdp::PATH']`` with whichever mmfsdp this interpreter
imports (the editable install in CI, else the working tree on PYTHONPATH).
Checked without openmim.
"""
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile

from harness import REPO

#: What setup.py needs to build a wheel, copied to keep the working tree clean.
SOURCE_ITEMS = ['setup.py', 'README.md', 'requirements.txt', 'MANIFEST.in', 'mmfsdp', 'configs',
                'tools']


def _repo_files(folder: str, suffixes: tuple) -> set:
    root = REPO / folder
    return {p.relative_to(root).as_posix() for p in root.rglob('*')
            if p.is_file() and p.suffix in suffixes and '__pycache__' not in p.parts}


def test_wheel_copies_configs_and_tools_into_mim(tmp_path):
    src = tmp_path / 'src'
    src.mkdir()
    ignore = shutil.ignore_patterns('__pycache__', '*.pyc', '*.egg-info')
    for item in SOURCE_ITEMS:
        path = REPO / item
        if path.is_dir():
            shutil.copytree(path, src / item, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(path, src / item)
    assert (src / 'mmfsdp' / '.mim' / 'configs').is_symlink()
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-build-isolation', '--no-deps',
                    '--no-index', '-q', '-w', str(tmp_path / 'dist'), str(src)],
                   check=True, capture_output=True, text=True, timeout=120)
    (wheel,) = (tmp_path / 'dist').glob('mmfsdp-*.whl')
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    mim = {n[len('mmfsdp/.mim/'):] for n in names if n.startswith('mmfsdp/.mim/')}
    expected = ({'model-index.yml'}
                | {f'configs/{f}' for f in _repo_files('configs', ('.py', '.yml'))}
                | {f'tools/{f}' for f in _repo_files('tools', ('.py', '.sh'))})
    assert mim == expected  # real files: setuptools followed the symlinks


def _mmfsdp_installed() -> bool:
    try:
        importlib.metadata.distribution('mmfsdp')
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


LOAD = """
import json, sys
import mmfsdp  # registers 'mmfsdp' for mmengine's 'pkg::' lookup
from mmengine.config import Config
cfgs = {path: Config.fromfile(path).to_dict() for path in sys.argv[1:]}
print(json.dumps(cfgs, default=str))
"""


def test_another_project_inherits_mmfsdp_configs(tmp_path):
    (tmp_path / 'bases.py').write_text(
        "_base_ = ['mmfsdp::_base_/models/gpt_nano.py', 'mmfsdp::_base_/default_runtime.py']\n"
        'model = dict(n_layer=2)\n')
    # mmengine 0.10.7 takes 'pkg::FOLDER/FILE' only: a top-level config is
    # reached through a folder.
    (tmp_path / 'experiment.py').write_text(
        "_base_ = ['mmfsdp::_base_/../gpt-nano_fsdp_2xcpu.py']\n"
        'train_cfg = dict(max_iters=40)\n')
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    if not _mmfsdp_installed():
        env['PYTHONPATH'] = str(REPO)
    out = subprocess.run([sys.executable, '-c', LOAD, 'bases.py', 'experiment.py'], cwd=tmp_path,
                         env=env, check=True, capture_output=True, text=True, timeout=120)
    results = json.loads(out.stdout.strip().splitlines()[-1])
    bases = results['bases.py']
    assert bases['model']['type'] == 'mmfsdp.GPT' and bases['model']['n_layer'] == 2
    assert bases['model']['n_embd'] == 128
    assert bases['default_hooks']['checkpoint']['save_last'] is True
    experiment = results['experiment.py']
    assert experiment['runner_type'] == 'mmfsdp.FSDPRunner'
    assert experiment['model_wrapper_cfg']['type'] == 'mmfsdp.MMFullyShardedDataParallel'
    assert experiment['train_cfg'] == dict(by_epoch=False, max_iters=40, val_interval=100)
