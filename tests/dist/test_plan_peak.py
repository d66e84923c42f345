"""The plan's step peak through ``python -m mmfsdp.plan``: the launch's allocator, what-ifs,
``--fit-memory``, vision configs.
"""
import json
import os
import subprocess
import sys

import pytest
from mmengine.registry import DATASETS
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import Dataset

from harness import REPO, SUPPORT
from mmfsdp.plan.allocator import GLIBC_MAX_MMAP_THRESHOLD, launch_allocator
from vision import IMAGES, PREPROCESSOR

CONFIG = 'configs/gpt-nano_fsdp_2xcpu.py'


def test_the_plan_assumes_the_allocator_the_launch_scripts_choose():
    """The launch scripts' own chooser, run: the opt-out, an LD_PRELOAD that names one,
    and a refusal (the launch would not start) as an error with its message."""
    base = {k: v for k, v in os.environ.items() if k not in ('LD_PRELOAD', 'MMFSDP_CPU_ALLOCATOR')}
    assert launch_allocator(dict(base, MMFSDP_CPU_ALLOCATOR='glibc')) == 'glibc'
    tcmalloc = dict(base, LD_PRELOAD='/opt/lib/libtcmalloc_minimal.so.4')
    assert launch_allocator(tcmalloc) == 'tcmalloc'
    with pytest.raises(ValueError, match="MMFSDP_CPU_ALLOCATOR='cache' is not one of"):
        launch_allocator(dict(base, MMFSDP_CPU_ALLOCATOR='cache'))


def _cli(capsys, *args):
    """The dry-run CLI in this process (no interpreter start-up), its standard output."""
    from mmfsdp.plan.__main__ import main
    capsys.readouterr()
    main([CONFIG, *args, '--cfg-options', 'train_dataloader.dataset.max_chars=20000'])
    return capsys.readouterr().out


def test_what_ifs_change_batch_and_checkpointing(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    plans = json.loads(_cli(capsys, '--world-size', '2', '--format', 'json', '--batch-size', '4',
                            '--activation-checkpointing', 'on', '--device', 'cpu',
                            '--cpu-allocator', 'tcmalloc'))
    step = plans[0]['step']
    assert step['batch_size'] == 4 and step['activation_checkpointing'] == ['TransformerBlock']
    grads = step['grads_freed_between_steps_bytes']
    assert grads > 0  # FSDP1 drops its gradients between steps
    heap = step['heap_activation_bytes']
    # each checkpointed block keeps its input, 4 x 64 x 128 floats: 128 KiB, in a size class
    assert heap > 0 and step['heap_threshold_bytes'] == 256 * 2**10
    assert step['peak_bytes'] == (step['model_state_bytes'] - grads + step['gathered_bytes']
                                  + heap + max(step['activation_bytes'] - heap, grads)
                                  + step['transient_bytes'])
    assert step['transient_bytes'] == max(step['traced_transient_bytes'], step['staging_bytes'])
    gpu = json.loads(_cli(capsys, '--world-size', '2', '--format', 'json', '--batch-size',
                          '4', '--activation-checkpointing', 'on', '--device', 'cuda'))[0]['step']
    assert gpu['heap_activation_bytes'] == 0 and gpu['staging_bytes'] == 0
    assert gpu['peak_bytes'] == (gpu['model_state_bytes'] - grads + gpu['gathered_bytes']
                                 + max(gpu['activation_bytes'], grads)
                                 + gpu['traced_transient_bytes'])
    # by default the plan assumes what tools/dist_train.sh would preload: here, the opt-out
    monkeypatch.setenv('MMFSDP_CPU_ALLOCATOR', 'glibc')
    monkeypatch.delenv('LD_PRELOAD', raising=False)
    monkeypatch.delenv('MALLOC_MMAP_THRESHOLD_', raising=False)
    opted_out = json.loads(_cli(capsys, '--world-size', '2', '--format', 'json', '--device',
                                'cpu'))[0]['step']
    assert opted_out['heap_threshold_bytes'] == GLIBC_MAX_MMAP_THRESHOLD
    default = json.loads(_cli(capsys, '--world-size', '2', '--format', 'json'))[0]['step']
    assert default['batch_size'] == 16 and default['activation_checkpointing'] == []
    assert default['activation_bytes'] > 4 * step['activation_bytes']


def test_fit_memory_lists_what_fits_cheapest_first(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    rows = json.loads(_cli(capsys, '--world-size', '1', '2', '4', '--fit-memory', '1GiB',
                           '--format', 'json'))
    assert {r['strategy'] for r in rows} >= {'DDP', 'FSDP1 FULL_SHARD',
                                             'FSDP2 reshard_after_forward=True'}
    assert {bool(r['activation_checkpointing']) for r in rows} == {False, True}
    assert all(r['fits'] == (r['peak_bytes'] <= 2**30) for r in rows)
    assert [r['world_size'] for r in rows] == sorted(r['world_size'] for r in rows)
    # every world size and strategy, checkpointing on and off (DDP takes it too)
    assert len(rows) == 3 * 10
    assert {bool(r['activation_checkpointing']) for r in rows if r['strategy'] == 'DDP'} == {
        False, True}
    text = _cli(capsys, '--world-size', '2', '8', '--fit-memory', '20MiB')
    assert 'smallest that fits: 2 ranks' in text or 'smallest that fits: 8 ranks' in text
    assert 'nothing fits' in _cli(capsys, '--world-size', '2', '--fit-memory', '1MiB')


@DATASETS.register_module(force=True)
class ImagesNotHere(Dataset):  # as mmpretrain's ImageNet without data/imagenet
    def __init__(self, data_root='data/imagenet'):
        raise FileNotFoundError(f"No such file or directory: '{data_root}/train'")


FSDP2_BF16 = dict(type='mmfsdp.MMFullyShard', mixed_precision=dict(param_dtype='bf16'))


def test_the_plan_of_a_vision_config_has_its_step_and_top_level_preprocessor(tmp_path):
    config = tmp_path / 'convbn.py'
    config.write_text(
        "custom_imports = dict(imports=['vision'], allow_failed_imports=False)\n"
        "model = dict(type='ConvBNClassifier')\n"
        f'data_preprocessor = {PREPROCESSOR!r}\n'
        f'train_dataloader = {IMAGES!r}\n'
        f'model_wrapper_cfg = {FSDP2_BF16!r}\n'
        "optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.abspath(__file__)), str(SUPPORT), str(REPO),
         os.environ.get('PYTHONPATH', '')]))
    out = subprocess.run([sys.executable, '-m', 'mmfsdp.plan', str(config), '--world-size',
                          '2', '--format', 'json'], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True, timeout=300).stdout
    step = json.loads(out)[0]['step']
    assert step is not None and step['activation_bytes'] > 0
    assert step['peak_bytes'] > step['activation_bytes']
    from mmengine.config import Config

    from mmfsdp.plan.__main__ import model_config
    cfg = Config.fromfile(str(config))
    model = model_config(cfg)
    assert model['data_preprocessor']['type'] == 'ImgDataPreprocessor'
    assert 'data_preprocessor' not in cfg.model  # the config itself is left as it is
    own = dict(type='BaseDataPreprocessor')
    cfg.model['data_preprocessor'] = own  # the model's own wins, as in mmengine's Runner
    assert model_config(cfg)['data_preprocessor'] == own


def _vision_config(tmp_path, **model):
    config = tmp_path / 'convbn_inline.py'
    config.write_text(
        f"model = dict(type='ConvBNClassifier', **{model!r})\n"
        f'data_preprocessor = {PREPROCESSOR!r}\n'
        f'train_dataloader = {IMAGES!r}\n'
        f'model_wrapper_cfg = {FSDP2_BF16!r}\n'
        "optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))\n")
    return str(config)


def _plan(capsys, *args):
    from mmfsdp.plan.__main__ import main
    capsys.readouterr()
    main(list(args))
    return capsys.readouterr()


def test_the_plan_converts_syncbn_on_a_cpu_host_as_the_runner_does(tmp_path, capsys):
    """FSDPRunner.build_model makes SyncBN BatchNorm on a CPU host; the plan of a CPU run too."""
    from mmengine.config import Config

    from mmfsdp.plan.__main__ import build_model
    config = _vision_config(tmp_path, sync_bn=True)
    cfg = Config.fromfile(config)
    on_cpu, converted = build_model(cfg, 'mmengine', 'cpu')
    assert converted == ['stem.1', 'block.1']
    for name in converted:  # mmengine's revert_sync_batchnorm: its _BatchNormXd
        norm = on_cpu.get_submodule(name)
        assert isinstance(norm, _BatchNorm) and not isinstance(norm, nn.SyncBatchNorm)
    # built without memory, but for the data preprocessor (small; its mean / std are real)
    assert all(t.is_meta for name, t in [*on_cpu.named_parameters(), *on_cpu.named_buffers()]
               if not name.startswith('data_preprocessor.'))
    on_gpu, converted = build_model(cfg, 'mmengine', 'cuda')
    assert converted == [] and isinstance(on_gpu.stem[1], nn.SyncBatchNorm)

    # the batch norms are units of their own under bf16 (fp32_modules): their class shows
    def units(device):
        out = _plan(capsys, config, '--world-size', '2', '--format', 'json', '--device', device)
        plan = json.loads(out.out)[0]
        assert plan['step']['activation_bytes'] > 0
        return {u['name']: u['cls'] for u in plan['units']}, out.err

    cpu, note = units('cpu')
    assert cpu['stem.1'] == cpu['block.1'] == '_BatchNormXd'
    assert 'planned as BatchNorm' in note and 'stem.1, block.1' in note
    gpu, note = units('cuda')
    assert gpu['stem.1'] == 'SyncBatchNorm' and 'planned as BatchNorm' not in note


def test_fit_memory_on_a_vision_config(tmp_path, capsys):
    config = _vision_config(tmp_path)
    rows = json.loads(_plan(capsys, config, '--world-size', '1', '2', '--fit-memory', '1GiB',
                            '--format', 'json', '--device', 'cpu').out)
    fsdp = [r for r in rows if r['strategy'] != 'DDP']
    assert fsdp and all(r['model_wrapper_cfg']['mixed_precision'] == dict(param_dtype='bf16')
                        for r in fsdp)
    assert all(r['compute_dtype'] == 'bfloat16' for r in fsdp)
    # nothing names layers to checkpoint: every candidate also tries the repeated blocks
    assert {r['activation_checkpointing'] == ['Sequential'] for r in rows} == {True, False}
    text = _plan(capsys, config, '--world-size', '2', '--fit-memory', '1GiB').out
    assert "AC on checkpoints Sequential (the model's repeated blocks, layer_cls='auto')" in text
    # a DDP config (no units) asks for layers to checkpoint: every candidate tries them (DDP
    # refuses mixed_precision: its parameters stay fp32)
    rows = json.loads(_plan(capsys, config, '--world-size', '2', '--fit-memory', '1GiB',
                            '--format', 'json', '--activation-checkpointing', 'Sequential',
                            '--cfg-options', 'model_wrapper_cfg.type='
                            'mmfsdp.MMDistributedDataParallel',
                            'model_wrapper_cfg.mixed_precision=None').out)
    assert {r['activation_checkpointing'] == ['Sequential'] for r in rows} == {True, False}
    assert 'DDP' in {r['strategy'] for r in rows}
    # fp32_modules carries over to every FSDP candidate
    rows = json.loads(_plan(capsys, config, '--world-size', '2', '--fit-memory', '1GiB',
                            '--format', 'json', '--cfg-options',
                            'model_wrapper_cfg.mixed_precision.fp32_modules=[]').out)
    assert all(r['model_wrapper_cfg']['mixed_precision']['fp32_modules'] == []
               for r in rows if r['strategy'] != 'DDP')
    # no dataset on this machine: one line that says so and names --input-shape
    with pytest.raises(SystemExit, match=r'--fit-memory needs one training step traced; '
                                         r'FileNotFoundError.*--input-shape'):
        _plan(capsys, config, '--world-size', '2', '--fit-memory', '1GiB', '--cfg-options',
              'train_dataloader.dataset.type=ImagesNotHere')
