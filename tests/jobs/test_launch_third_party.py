"""Another project uses mmfsdp: inherits its configs, trains with its own train script.

The project lives in a temporary directory, outside this repository. Its
configs inherit ours through ``mmfsdp::`` (a top-level config, and the
``_base_/`` pieces with a wrapper of its own), and its ``tools/train.py`` is
written the OpenMMLab way (``--amp`` sets ``type='AmpOptimWrapper'``). Each
config trains a few iterations on 2 processes under ``torchrun`` and is planned
by ``python -m mmfsdp.plan``. A second project with its own registry and
``default_scope`` is planned with unprefixed names.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from harness import REPO, free_port, job_env, run_job

TRAIN_LOSS = re.compile(r'Iter\(train\) \[\s*(\d+)/\d+\].*?\bloss: ([0-9.]+)')

#: An OpenMMLab-style train script (mmpretrain's ``--amp`` handling), plus the
#: one line mmfsdp asks for: import it before ``Config.fromfile`` reads ``mmfsdp::``.
TRAIN_PY = """
import argparse
from mmengine.config import Config, DictAction
from mmengine.registry import RUNNERS
from mmengine.runner import Runner
import mmfsdp  # noqa: F401  (mmengine's 'mmfsdp::' lookup)

parser = argparse.ArgumentParser()
parser.add_argument('config')
parser.add_argument('--work-dir')
parser.add_argument('--amp', action='store_true')
parser.add_argument('--launcher', default='none')
parser.add_argument('--cfg-options', nargs='+', action=DictAction)
args = parser.parse_args()
cfg = Config.fromfile(args.config)
cfg.launcher = args.launcher
cfg.work_dir = args.work_dir
if args.cfg_options:
    cfg.merge_from_dict(args.cfg_options)
if args.amp:
    cfg.optim_wrapper.type = 'AmpOptimWrapper'
    cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')
runner = RUNNERS.build(cfg) if 'runner_type' in cfg else Runner.from_cfg(cfg)
runner.train()
"""
#: The demo config, whole, through the folder mmengine 0.10.7 requires.
FSDP1_CONFIG = """
_base_ = ['mmfsdp::_base_/../gpt-nano_fsdp_2xcpu.py']
model = dict(n_layer=2)
"""
#: The pieces, with this project's own wrapper and optimizer wrapper.
FSDP2_CONFIG = """
_base_ = ['mmfsdp::_base_/models/gpt_nano.py', 'mmfsdp::_base_/datasets/stdlib_chars.py',
          'mmfsdp::_base_/schedules/iter_based.py', 'mmfsdp::_base_/default_runtime.py']
model = dict(n_layer=2)
runner_type = 'mmfsdp.FSDPRunner'
model_wrapper_cfg = dict(type='mmfsdp.MMFullyShard',
                         auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']))
optim_wrapper = dict(_delete_=True, type='OptimWrapper', optimizer=dict(type='AdamW', lr=2e-3))
"""
SHORT = ['train_cfg.max_iters=4', 'train_cfg.val_interval=4', 'default_hooks.logger.interval=2',
         'train_dataloader.batch_size=8', 'val_dataloader.dataset.num_samples=32',
         'train_dataloader.dataset.max_chars=200000', 'val_dataloader.dataset.max_chars=200000']


def _run(cmd: List[str], cwd: Path, env: dict = None, merge_stderr: bool = True) -> str:
    """Run ``cmd`` in ``cwd`` with this repository importable; return its output, or fail."""
    return run_job(cmd, env=env or job_env(REPO), cwd=cwd, merge_stderr=merge_stderr)


@pytest.fixture(scope='module')
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp('project')
    (root / 'tools').mkdir()
    (root / 'tools' / 'train.py').write_text(TRAIN_PY)
    (root / 'configs').mkdir()
    (root / 'configs' / 'fsdp1.py').write_text(FSDP1_CONFIG)
    (root / 'configs' / 'fsdp2.py').write_text(FSDP2_CONFIG)
    return root


def _train(project: Path, config: str, *extra: str) -> dict:
    work_dir = project / 'work_dirs' / config
    log = _run([sys.executable, '-m', 'torch.distributed.run', '--nproc-per-node', '2',
                '--master-port', str(free_port()), 'tools/train.py', f'configs/{config}.py',
                '--launcher', 'pytorch', '--work-dir', str(work_dir), *extra,
                '--cfg-options', *SHORT], project)
    return dict(log=log, losses=[float(loss) for _, loss in TRAIN_LOSS.findall(log)],
                files=sorted(os.listdir(work_dir)))


@pytest.fixture(scope='module')
def fsdp1_run(project) -> dict:
    return _train(project, 'fsdp1')


@pytest.fixture(scope='module')
def fsdp2_amp_run(project) -> dict:
    return _train(project, 'fsdp2', '--amp')


def test_inherited_top_level_config_trains_on_2_ranks(fsdp1_run):
    assert 'mmfsdp.MMFullyShardedDataParallel FULL_SHARD, world size 2' in fsdp1_run['log']
    assert len(fsdp1_run['losses']) == 2 and fsdp1_run['losses'][1] < fsdp1_run['losses'][0]
    assert 'iter_4.pth' in fsdp1_run['files']


def test_a_run_with_nothing_wrong_logs_no_warning(fsdp1_run):
    # Before: the loops' "Dataset StdlibCharDataset has no metainfo" (x2) and the stock
    # CheckpointHook's "FileClient" / "HardDiskBackend" deprecation notices.
    assert [line for line in fsdp1_run['log'].splitlines() if ' - WARNING - ' in line] == []


def test_inherited_base_pieces_train_with_fsdp2_on_2_ranks(fsdp2_amp_run):
    assert 'mmfsdp.MMFullyShard reshard_after_forward=True, world size 2' in fsdp2_amp_run['log']
    assert len(fsdp2_amp_run['losses']) == 2
    assert fsdp2_amp_run['losses'][1] < fsdp2_amp_run['losses'][0]
    assert 'iter_4.pth' in fsdp2_amp_run['files']


def test_third_party_amp_flag_gets_mmfsdp_amp_optim_wrapper_and_says_so(fsdp2_amp_run):
    assert ("optim_wrapper.type: mmengine's AmpOptimWrapper replaced by mmfsdp.AmpOptimWrapper"
            in fsdp2_amp_run['log'])
    # mmengine's own AmpOptimWrapper asserts CUDA when it is built: on a CPU-only
    # machine, training at all shows it was not.
    assert len(fsdp2_amp_run['losses']) == 2


@pytest.mark.parametrize('config, wrapper', [('fsdp1', 'mmfsdp.MMFullyShardedDataParallel'),
                                             ('fsdp2', 'mmfsdp.MMFullyShard')])
def test_plan_cli_plans_the_inherited_config(project, config, wrapper):
    out = _run([sys.executable, '-m', 'mmfsdp.plan', f'configs/{config}.py', '--world-size', '2',
                '--format', 'json'], project, merge_stderr=False)
    (plan,) = json.loads(out)
    assert plan['wrapper'] == wrapper
    assert [u['name'] for u in plan['units']][-2:] == ['blocks.0', 'blocks.1']


#: A project with its own registry scope, as OpenMMLab packages have.
TINY_REGISTRY = """
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import Registry
MODELS = Registry('model', parent=MMENGINE_MODELS, scope='tinyproj', locations=['tinyproj.models'])
"""
TINY_MODELS = """
from mmengine.model import BaseModel
from torch import nn
from .registry import MODELS

@MODELS.register_module()
class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

@MODELS.register_module()
class TinyNet(BaseModel):
    def __init__(self, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(TinyBlock() for _ in range(depth))

    def forward(self, inputs, data_samples=None, mode='tensor'):
        for block in self.blocks:
            inputs = block.fc(inputs)
        return inputs
"""
#: Unprefixed names, resolved in the default scope (``TinyNet``) or in mmfsdp's.
SCOPED_CONFIGS = {
    'tinyproj.py': """
default_scope = 'tinyproj'
model = dict(type='TinyNet', depth=3)
model_wrapper_cfg = dict(type='mmfsdp.MMFullyShardedDataParallel',
                         auto_wrap_policy=dict(type='transformer', layer_cls=['TinyBlock']))
""",
    'mmfsdp_scope.py': """
default_scope = 'mmfsdp'
model = dict(type='GPT', n_layer=3, n_embd=32, n_head=2, block_size=16, vocab_size=256)
model_wrapper_cfg = dict(type='MMFullyShard',
                         auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']))
""",
}


@pytest.mark.parametrize('config, wrapper', [('tinyproj.py', 'mmfsdp.MMFullyShardedDataParallel'),
                                             ('mmfsdp_scope.py', 'mmfsdp.MMFullyShard')])
def test_plan_cli_finds_unprefixed_names_in_the_default_scope(tmp_path, config, wrapper):
    (tmp_path / 'tinyproj').mkdir()
    (tmp_path / 'tinyproj' / '__init__.py').write_text('')
    (tmp_path / 'tinyproj' / 'registry.py').write_text(TINY_REGISTRY)
    (tmp_path / 'tinyproj' / 'models.py').write_text(TINY_MODELS)
    (tmp_path / config).write_text(SCOPED_CONFIGS[config])
    env = job_env(REPO, tmp_path)
    out = _run([sys.executable, '-m', 'mmfsdp.plan', config, '--world-size', '2',
                '--format', 'json'], tmp_path, env, merge_stderr=False)
    (plan,) = json.loads(out)
    assert plan['wrapper'] == wrapper
    assert [u['name'] for u in plan['units']][-3:] == ['blocks.0', 'blocks.1', 'blocks.2']


def test_our_config_loader_hides_mmengines_pkg_resources_warning_only(tmp_path):
    (tmp_path / 'usermod.py').write_text("import warnings\nwarnings.warn('the user warns')\n")
    (tmp_path / 'experiment.py').write_text(
        FSDP1_CONFIG + "custom_imports = dict(imports=['usermod'])\n")
    load = ('import mmfsdp\nfrom mmfsdp.registry import load_config\n'
            "load_config('experiment.py')\n")
    done = subprocess.run([sys.executable, '-c', load], cwd=tmp_path, env=job_env(REPO),
                          capture_output=True, text=True, timeout=120, check=True)
    assert 'the user warns' in done.stderr  # imported while the config loads
    assert 'pkg_resources' not in done.stderr
