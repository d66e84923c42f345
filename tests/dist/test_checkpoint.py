"""Checkpoints lose nothing: exact resume, resharding 2 <-> 4, plain and safe loading.

All runs keep the global batch at 8 samples whatever the world size, so runs at
different world sizes train the same numbers. Process groups:

- 2 ranks: uninterrupted runs that save at iteration 3 (both types, FSDP and
  DDP), and runs resumed from those checkpoints;
- 4 ranks: the 2-rank checkpoints resumed at 4, and 4-rank runs that save;
- 2 ranks: the 4-rank checkpoints and an ordinary mmengine checkpoint resumed at 2.

This process resumes the 2-rank checkpoints without any process group, and
checks consolidation, plain loading and what ``torch.load`` accepts.
"""
import functools
import os
import subprocess
import sys
import warnings

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from harness import max_abs_diff, run_distributed
from mmfsdp import FSDPRunner
from mmfsdp.checkpoint import META_FILE, UnsafeCheckpointError
from payloads import CreatesFile
from toy import DDP, FSDP1, ToyClassifier, checkpointing_config, runner_config

WRAPPERS = {'fsdp': FSDP1, 'ddp': DDP}
TYPES = ('full', 'sharded')
GLOBAL_BATCH, HALF, TOTAL = 8, 3, 6
SAME_WORLD_TOL, OTHER_WORLD_TOL = 1e-6, 2e-5
PROBE = torch.linspace(-2, 2, 5 * 6).reshape(5, 6)


#: Saves at iteration ``HALF`` of ``TOTAL``; the global batch is the same at every world size.
_config = functools.partial(checkpointing_config, global_batch=GLOBAL_BATCH, max_iters=TOTAL,
                            interval=HALF)


def _final_state(runner) -> dict:
    from mmfsdp.checkpoint.state import gather_full_state
    model, optimizer = gather_full_state(runner.model, runner.optim_wrapper)
    return dict(model={k: v.clone() for k, v in model.items()},
                optimizer=optimizer['state'], iter=runner.iter)


def _train(work_dir: str, wrapper: dict, world_size: int, **kwargs) -> dict:
    runner = FSDPRunner.from_cfg(_config(work_dir, wrapper, world_size, **kwargs))
    runner.train()
    result = _final_state(runner)
    with torch.no_grad():
        result['probe'] = runner.model(PROBE, mode='tensor').clone()
    return result


def _ckpt(root: str, run: str, iteration: int = HALF) -> str:
    return os.path.join(root, run, f'iter_{iteration}.pth')


def _two_ranks(root: str) -> dict:
    import mmfsdp  # noqa: F401
    out = {}
    for wrapper in WRAPPERS:
        for kind in TYPES:
            run = f'{wrapper}-{kind}'
            out[f'uninterrupted/{run}'] = _train(f'{root}/{run}', WRAPPERS[wrapper], 2,
                                                 state_dict_type=kind)
            out[f'resumed/{run}'] = _train(f'{root}/{run}-resumed', WRAPPERS[wrapper], 2,
                                           resume_from=_ckpt(root, run))
    return out if torch.distributed.get_rank() == 0 else None


def _four_ranks(root: str) -> dict:
    import mmfsdp  # noqa: F401
    out = {}
    for kind in TYPES:
        out[f'2to4/{kind}'] = _train(f'{root}/fsdp-{kind}-at4', FSDP1, 4,
                                     resume_from=_ckpt(root, f'fsdp-{kind}'))
        _train(f'{root}/fsdp4-{kind}', FSDP1, 4, state_dict_type=kind)
    return out if torch.distributed.get_rank() == 0 else None


def _back_to_two_ranks(root: str, stock_checkpoint: str) -> dict:
    import mmfsdp  # noqa: F401
    out = {}
    for kind in TYPES:
        out[f'4to2/{kind}'] = _train(f'{root}/fsdp4-{kind}-at2', FSDP1, 2,
                                     resume_from=_ckpt(root, f'fsdp4-{kind}'))
    try:
        _train(f'{root}/stock-refused', FSDP1, 2, resume_from=stock_checkpoint)
        out['stock/refused'] = None
    except UnsafeCheckpointError as e:
        out['stock/refused'] = str(e)
    out['stock/opted-in'] = _train(f'{root}/stock-at2', FSDP1, 2, resume_from=stock_checkpoint,
                                   allow_unsafe_checkpoints=True)
    return out if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('ckpt'))


@pytest.fixture(scope='module')
def stock_checkpoint(root) -> str:
    """An ordinary checkpoint of mmengine's stock Runner, one process, at iteration 3."""
    cfg = runner_config('stock', f'{root}/stock', batch_size=GLOBAL_BATCH, max_iters=HALF,
                        launcher='none')
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=HALF,
                                              by_epoch=False)
    Runner.from_cfg(Config(cfg)).train()
    return _ckpt(root, 'stock')


@pytest.fixture(scope='module')
def runs(root, stock_checkpoint) -> dict:
    results = run_distributed(_two_ranks, 2, root)[0]
    results.update(run_distributed(_four_ranks, 4, root)[0])
    results.update(run_distributed(_back_to_two_ranks, 2, root, stock_checkpoint)[0])
    return results


def _assert_same_training(got: dict, expected: dict, tol: float) -> None:
    assert got['iter'] == expected['iter'] == TOTAL
    model_diff = max_abs_diff(got['model'], expected['model'])
    optim_diff = max_abs_diff(got['optimizer'], expected['optimizer'])
    print(f'max abs diff: weights {model_diff:.1e}, optimizer state {optim_diff:.1e}')
    assert model_diff <= tol and optim_diff <= tol


@pytest.mark.parametrize('run', [f'{w}-{k}' for w in WRAPPERS for k in TYPES])
def test_resume_equals_uninterrupted_training(runs, run):
    _assert_same_training(runs[f'resumed/{run}'], runs[f'uninterrupted/{run}'], SAME_WORLD_TOL)


@pytest.mark.parametrize('kind', TYPES)
def test_checkpoint_from_2_ranks_resumes_at_4(runs, kind):
    _assert_same_training(runs[f'2to4/{kind}'], runs['uninterrupted/fsdp-full'],
                          OTHER_WORLD_TOL)


@pytest.mark.parametrize('kind', TYPES)
def test_checkpoint_from_4_ranks_resumes_at_2(runs, kind):
    _assert_same_training(runs[f'4to2/{kind}'], runs['uninterrupted/fsdp-full'],
                          OTHER_WORLD_TOL)


@pytest.mark.parametrize('kind', TYPES)
def test_checkpoint_from_2_ranks_resumes_in_one_process(runs, root, kind):
    runner = FSDPRunner.from_cfg(_config(f'{root}/fsdp-{kind}-at1', FSDP1, 1,
                                         resume_from=_ckpt(root, f'fsdp-{kind}')))
    runner.train()
    _assert_same_training(_final_state(runner), runs['uninterrupted/fsdp-full'],
                          OTHER_WORLD_TOL)


@pytest.mark.parametrize('kind', TYPES)
def test_load_from_reads_the_weights_in_one_process(runs, root, kind):
    cfg = _config(f'{root}/load-{kind}', FSDP1, 1)
    runner = FSDPRunner.from_cfg(cfg)
    runner.load_checkpoint(_ckpt(root, f'fsdp-{kind}', TOTAL))
    expected = runs['uninterrupted/fsdp-full']['model']
    assert max_abs_diff(runner.model.state_dict(), expected) == 0


def test_one_process_use_of_a_sharded_checkpoint_is_quiet(runs, root):
    runner = FSDPRunner.from_cfg(_config(f'{root}/quiet', FSDP1, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        runner.load_checkpoint(_ckpt(root, 'fsdp-sharded', TOTAL))
    assert [str(w.message) for w in caught if 'single process' in str(w.message)] == []


def test_full_checkpoint_loads_strictly_into_the_plain_model(runs, root):
    from mmengine.runner import load_checkpoint
    model = ToyClassifier()
    load_checkpoint(model, _ckpt(root, 'fsdp-full', TOTAL), strict=True)
    with torch.no_grad():
        probe = model(PROBE, mode='tensor')
    diff = (probe - runs['uninterrupted/fsdp-full']['probe']).abs().max().item()
    print(f'plain model vs sharded model outputs: max abs diff {diff:.1e}')
    assert diff <= SAME_WORLD_TOL  # same weights; only the kernels' summation order differs


@pytest.mark.parametrize('path', ['fsdp-full/iter_3.pth', f'fsdp-sharded/iter_3.pth/{META_FILE}',
                                  'ddp-full/iter_6.pth'])
def test_our_checkpoints_load_with_torch_defaults(root, path):
    checkpoint = torch.load(os.path.join(root, path))  # weights_only=True by default
    assert checkpoint['meta']['iter'] in (HALF, TOTAL)
    assert 'message_hub' in checkpoint


def test_consolidation_turns_a_sharded_directory_into_the_full_file(root, tmp_path):
    dst = str(tmp_path / 'consolidated.pth')
    done = subprocess.run([sys.executable, '-m', 'mmfsdp.consolidate',
                           _ckpt(root, 'fsdp-sharded'), dst], check=True, capture_output=True,
                          text=True)
    assert done.stderr == ''  # nothing to warn about
    consolidated = torch.load(dst)
    full = torch.load(_ckpt(root, 'fsdp-full'))
    assert max_abs_diff(consolidated['state_dict'], full['state_dict']) == 0
    assert max_abs_diff(consolidated['optimizer']['state'], full['optimizer']['state']) == 0
    assert consolidated['meta']['iter'] == full['meta']['iter']


def test_consolidate_help_names_the_command_to_type(capsys):
    # The command's main in this process: the help is argparse's, whatever the interpreter
    # (the two tests around this one run `python -m mmfsdp.consolidate` itself).
    from mmfsdp.consolidate import main
    with pytest.raises(SystemExit) as exited:
        main(['--help'])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(
        'usage: python -m mmfsdp.consolidate [-h] [--allow-unsafe-checkpoints] src dst')


def test_consolidation_refuses_a_missing_output_directory_like_cp(root, tmp_path):
    dst = tmp_path / 'missing' / 'full.pth'
    done = subprocess.run([sys.executable, '-m', 'mmfsdp.consolidate',
                           _ckpt(root, 'fsdp-sharded'), str(dst)], capture_output=True, text=True)
    assert done.returncode == 1
    assert done.stderr == (f'python -m mmfsdp.consolidate: error: cannot write {dst}: the '
                           f'directory {dst.parent} does not exist\n')
    assert not dst.parent.exists()


def test_ordinary_mmengine_checkpoint_needs_the_opt_in(runs, stock_checkpoint):
    message = runs['stock/refused']
    assert message is not None and stock_checkpoint in message
    assert 'allow_unsafe_checkpoints = True' in message


def test_ordinary_mmengine_checkpoint_resumes_after_opt_in(runs):
    _assert_same_training(runs['stock/opted-in'], runs['uninterrupted/fsdp-full'],
                          OTHER_WORLD_TOL)


def test_checkpoint_with_unexpected_globals_executes_nothing(tmp_path):
    marker = tmp_path / 'created-by-unpickling'
    path = str(tmp_path / 'evil.pth')
    torch.save(dict(state_dict={}, meta=dict(iter=1), payload=CreatesFile(str(marker))), path)
    cfg = runner_config('evil', str(tmp_path / 'work'), batch_size=8, launcher='none',
                        wrapper=FSDP1)
    cfg.update(load_from=path)
    runner = FSDPRunner.from_cfg(Config(cfg))
    with pytest.raises(UnsafeCheckpointError, match='allow_unsafe_checkpoints = True'):
        runner.train()
    assert not marker.exists()
