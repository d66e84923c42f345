"""mmengine's model contract under every wrapper: clipping, default wrapper, names.

The scenarios run in two 2-process gloo groups (steps and clipping; TTA and
names); each is compared with mmengine's *stock* ``Runner`` on one process
(global batch, no mmfsdp code).
"""
import copy
import os
from typing import Optional

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

import contract_models  # noqa: F401  (registers the models)
from harness import max_abs_diff, run_distributed, scalar_history
from toy import DDP, WRAPPERS, runner_config, train_one_process

TOL = 2e-5
PER_RANK_BATCH, WORLD_SIZE = 4, 2
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])

ADAMW = dict(optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.0))
CLIP = dict(optimizer=dict(type='AdamW', lr=1e-2), clip_grad=dict(max_norm=0.05))
FROZEN = dict(type='FrozenBackboneClassifier')

GAN = dict(type='ToyGAN')
#: Two optimizers built by a constructor, each clipping its own parameters.
GAN_OPTIM = dict(constructor='PerChildOptimConstructor',
                 generator=dict(optimizer=dict(type='AdamW', lr=1e-2),
                                clip_grad=dict(max_norm=0.02)),
                 discriminator=dict(optimizer=dict(type='AdamW', lr=1e-2),
                                    clip_grad=dict(max_norm=0.03)))
#: The wrapper types users write for a GAN (mmagic: mmengine's separate DDP).
GAN_WRAPPERS = dict(fsdp1=dict(type='mmfsdp.MMFullyShardedDataParallel'),
                    fsdp2=dict(type='mmfsdp.MMFullyShard'),
                    ddp=dict(type='MMSeparateDistributedDataParallel'))

#: name -> (model, model_wrapper_cfg, optim_wrapper)
SCENARIOS = {
    **{f'frozen_backbone_clip/{w}': (FROZEN, cfg, CLIP) for w, cfg in WRAPPERS.items()},
    'no_type/find_unused_parameters': (dict(type='ToyClassifier'),
                                       dict(find_unused_parameters=True), ADAMW),
}


def _config(name: str, root: str, model: dict, optim_wrapper: dict, **kwargs) -> dict:
    cfg = runner_config(name.replace('/', '-'), f'{root}/{name}',
                        optim_wrapper=copy.deepcopy(optim_wrapper), **kwargs)
    cfg['model'] = copy.deepcopy(model)
    return cfg


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone().float() for k, v in state.items()}


#: wrapper -> checkpoint type of the ``module``-named model's runs
NAMED_CHECKPOINTS = dict(fsdp1='sharded', fsdp2='sharded', ddp='full')
NAMED = dict(type='ModuleNamedClassifier')
NAMED_OPTIM = dict(ADAMW, constructor='WholeModelConstructor')
HALF, TOTAL = 3, 6


def _named_config(root: str, run: str, wrapper: Optional[dict], world_size: int, kind: str,
                  resume_from: Optional[str] = None) -> Config:
    """Six steps of the ``module``-named model at a global batch of 8, saving at 3."""
    cfg = _config(run, root, NAMED, NAMED_OPTIM, wrapper=wrapper, max_iters=TOTAL,
                  batch_size=PER_RANK_BATCH * WORLD_SIZE // world_size,
                  launcher='pytorch' if wrapper else 'none')
    if wrapper is None:
        cfg['runner_type'] = 'mmfsdp.FSDPRunner'
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=HALF,
                                              by_epoch=False, state_dict_type=kind)
    if resume_from:
        cfg.update(load_from=resume_from, resume=True)
    return Config(cfg)


def _train_named(root: str, run: str, wrapper: Optional[dict], world_size: int, kind: str,
                 resume_from: Optional[str] = None) -> dict:
    from mmfsdp import FSDPRunner
    runner = FSDPRunner.from_cfg(_named_config(root, run, wrapper, world_size, kind,
                                               resume_from))
    runner.train()
    return dict(state=_full_state(runner.model), iter=runner.iter)


TTA = dict(tta_model=dict(type='ToyTTAModel'),
           tta_pipeline=[dict(type='ToyScales', scales=[1.0, 0.5, 2.0])])


def _tta_config(root: str, run: str, checkpoint: str, **kwargs) -> Config:
    """``tools/test.py --tta`` of the toy classifier at ``checkpoint``."""
    from mmfsdp.tta import tta_config
    cfg = _config(run, root, dict(type='ToyClassifier'), ADAMW, val=True,
                  batch_size=PER_RANK_BATCH, **kwargs)
    cfg['test_dataloader']['dataset']['type'] = 'ToyTTADataset'
    cfg.update(TTA, load_from=checkpoint)
    return tta_config(Config(cfg))


def _uneven_val_config(root: str, run: str, batch_size: int, **kwargs) -> Config:
    """Validation where the ranks see different numbers of batches (5 samples, no padding)."""
    cfg = _config(run, root, dict(type='BufferedClassifier'), ADAMW, val=True, max_iters=2,
                  batch_size=batch_size, **kwargs)
    cfg['val_dataloader'].update(batch_size=1, sampler=dict(type='DefaultSampler',
                                                            shuffle=False, round_up=False))
    cfg['val_dataloader']['dataset']['length'] = 5
    return Config(cfg)


def _run_all(root: str) -> dict:
    from mmfsdp import FSDPRunner
    results = {}
    for name, (model, wrapper, optim) in SCENARIOS.items():
        cfg = Config(_config(name, root, model, optim, wrapper=wrapper,
                             batch_size=PER_RANK_BATCH))
        runner = FSDPRunner.from_cfg(cfg)
        runner.train()
        results[name] = dict(state=_full_state(runner.model),
                             grad_norm=scalar_history(runner, 'train/grad_norm'),
                             wrapper=type(runner.model).__name__,
                             find_unused=getattr(runner.model, 'find_unused_parameters', None),
                             cfg_after=cfg.model_wrapper_cfg.to_dict())
    runner = FSDPRunner.from_cfg(_uneven_val_config(
        root, 'uneven-val', PER_RANK_BATCH, wrapper=dict(DDP, broadcast_buffers=True)))
    runner.train()
    results['ddp/uneven_val'] = runner.val()
    for wrapper, wrapper_cfg in GAN_WRAPPERS.items():
        cfg = Config(_config(f'gan-{wrapper}', root, GAN, GAN_OPTIM, wrapper=wrapper_cfg,
                             batch_size=PER_RANK_BATCH, val=True))
        runner = FSDPRunner.from_cfg(cfg)
        runner.train()
        results[f'gan/{wrapper}'] = dict(state=_full_state(runner.model), val=runner.val(),
                                         test=runner.test(), wrapper=type(runner.model).__name__)
    try:
        FSDPRunner.from_cfg(Config(_config('gan-refused', root, GAN, GAN_OPTIM, wrapper=DDP,
                                           batch_size=PER_RANK_BATCH))).train()
        results['gan/refused'] = None
    except ValueError as e:
        results['gan/refused'] = str(e)
    return results if torch.distributed.get_rank() == 0 else None


def _run_tta_and_names(root: str) -> dict:
    from mmfsdp import FSDPRunner
    results = {}
    for wrapper, wrapper_cfg in WRAPPERS.items():
        runner = FSDPRunner.from_cfg(_tta_config(root, f'tta-{wrapper}', f'{root}/tta.pth',
                                                 wrapper=wrapper_cfg))
        results[f'tta/{wrapper}'] = dict(test=runner.test(),
                                         model=type(runner.model.module).__name__)
    for wrapper, kind in NAMED_CHECKPOINTS.items():
        run = f'named-{wrapper}'
        results[f'named/{wrapper}'] = _train_named(root, run, WRAPPERS[wrapper], 2, kind)
        results[f'named/{wrapper}/resumed'] = _train_named(
            root, f'{run}-resumed', WRAPPERS[wrapper], 2, kind,
            resume_from=f'{root}/{run}/iter_{HALF}.pth')
    return results if torch.distributed.get_rank() == 0 else None


def _run_everything(root: str) -> dict:
    results = _run_all(root)
    tta_and_names = _run_tta_and_names(root)
    return dict(results, **tta_and_names) if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope='module')
def distributed(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp('dist'))
    _train_tta_checkpoint(f'{root}/tta.pth')
    # One process group for both halves (starting one costs more than most checks); the
    # deadline is two groups' 240 s, as the whole once overran 240 s under load.
    return dict(run_distributed(_run_everything, WORLD_SIZE, root, timeout=480)[0], root=root)


def _train_tta_checkpoint(path: str) -> None:
    """A few steps of the toy classifier, saved as a full mmfsdp checkpoint at ``path``."""
    from mmfsdp import FSDPRunner
    cfg = _config('tta-train', os.path.dirname(path), dict(type='ToyClassifier'), ADAMW,
                  launcher='none', batch_size=PER_RANK_BATCH * WORLD_SIZE, max_iters=4)
    cfg['runner_type'] = 'mmfsdp.FSDPRunner'
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    runner.save_checkpoint(os.path.dirname(path), os.path.basename(path))


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """Single-process runs of mmengine's stock Runner, memoised per (model, optim)."""
    cache, root = {}, tmp_path_factory.mktemp('ref')

    def run(model: dict, optim: dict, val: bool = False) -> dict:
        key = repr((model, optim, val))
        if key not in cache:
            cfg = _config(f'ref{len(cache)}', str(root), model, optim, launcher='none',
                          batch_size=PER_RANK_BATCH * WORLD_SIZE, val=val)
            cache[key] = train_one_process(cfg, val)
        return cache[key]

    return run


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_frozen_backbone_clipping_equals_one_process(wrapper, distributed, reference):
    """Every rank joins the global norm, even one whose shard has no gradient."""
    model, _, optim = SCENARIOS[f'frozen_backbone_clip/{wrapper}']
    got, ref = distributed[f'frozen_backbone_clip/{wrapper}'], reference(model, optim)
    diff = max_abs_diff(got['state'], ref['state'])
    print(f'{wrapper}: max abs diff {diff:.2e}')
    assert diff <= TOL
    assert got['grad_norm'] == pytest.approx(ref['grad_norm'], rel=1e-4)
    assert min(ref['grad_norm']) > optim['clip_grad']['max_norm']  # clipping was active


def test_wrapper_config_without_type_is_mmfsdp_ddp(distributed, reference):
    model, _, optim = SCENARIOS['no_type/find_unused_parameters']
    got = distributed['no_type/find_unused_parameters']
    assert got['wrapper'] == 'MMDistributedDataParallel'
    assert got['find_unused'] is True
    assert got['cfg_after'] == dict(find_unused_parameters=True)  # the user's config untouched
    assert max_abs_diff(got['state'], reference(model, optim)['state']) <= TOL


@pytest.mark.parametrize('wrapper', list(NAMED_CHECKPOINTS))
def test_child_named_module_trains_equal_to_one_process(wrapper, distributed, reference):
    got = distributed[f'named/{wrapper}']['state']
    assert {'module.weight', 'neck.module.weight'} <= set(got)
    assert max_abs_diff(got, reference(NAMED, NAMED_OPTIM)['state']) <= TOL


@pytest.mark.parametrize('wrapper', list(NAMED_CHECKPOINTS))
def test_child_named_module_resumes_exactly(wrapper, distributed):
    resumed = distributed[f'named/{wrapper}/resumed']
    assert resumed['iter'] == TOTAL
    assert max_abs_diff(resumed['state'], distributed[f'named/{wrapper}']['state']) <= 1e-6


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2'])
def test_child_named_module_reshards_to_one_process(wrapper, distributed, tmp_path_factory):
    """The 2-rank sharded checkpoint resumes in this process (no process group)."""
    root = str(distributed['root'])
    got = _train_named(str(tmp_path_factory.mktemp('one')), f'{wrapper}-at1', None, 1,
                       'full', resume_from=f'{root}/named-{wrapper}/iter_{HALF}.pth')
    assert max_abs_diff(got['state'], distributed[f'named/{wrapper}']['state']) <= TOL


@pytest.mark.parametrize('wrapper', list(GAN_WRAPPERS))
def test_gan_with_own_train_step_equals_one_process(wrapper, distributed, reference):
    """Own train_step, two optimizers from a constructor, each clipping its own parameters."""
    got = distributed[f'gan/{wrapper}']
    diff = max_abs_diff(got['state'], reference(GAN, GAN_OPTIM, val=True)['state'])
    print(f'gan/{wrapper} ({got["wrapper"]}): max abs diff {diff:.2e}')
    assert diff <= TOL


@pytest.mark.parametrize('wrapper', list(GAN_WRAPPERS))
def test_own_val_and_test_steps_give_their_predictions(wrapper, distributed, reference):
    ref = reference(GAN, GAN_OPTIM, val=True)
    for loop in ('val', 'test'):
        got = distributed[f'gan/{wrapper}'][loop]
        assert sorted(got) == ['accuracy', 'nll']
        assert got['nll'] == pytest.approx(ref[loop]['nll'], abs=TOL)
        assert got['accuracy'] == ref[loop]['accuracy']


def test_ddp_over_a_model_with_own_train_step_is_refused(distributed):
    message = distributed['gan/refused']
    assert message is not None, 'mmfsdp.MMDistributedDataParallel trained a GAN it cannot sync'
    assert 'MMSeparateDistributedDataParallel' in message and 'train_step' in message


@pytest.mark.parametrize('wrapper', list(WRAPPERS))
def test_tta_equals_one_process(wrapper, distributed, tmp_path_factory):
    """``--tta``: a ``BaseTTAModel`` around the model, loaded from a plain checkpoint."""
    root = str(distributed['root'])
    runner = Runner.from_cfg(_tta_config(str(tmp_path_factory.mktemp('tta')), 'tta-ref',
                                         f'{root}/tta.pth', launcher='none'))
    expected = runner.test()
    got = distributed[f'tta/{wrapper}']
    assert got['model'] == 'ToyTTAModel'
    assert sorted(got['test']) == ['accuracy', 'nll']
    assert got['test']['nll'] == pytest.approx(expected['nll'], abs=TOL)
    assert got['test']['accuracy'] == expected['accuracy']


def test_ddp_evaluation_is_no_collective(distributed, tmp_path_factory):
    """broadcast_buffers=True and 3 vs 2 val batches: DDP.forward would hang on the third."""
    runner = Runner.from_cfg(_uneven_val_config(str(tmp_path_factory.mktemp('uneven')),
                                                'uneven-ref', PER_RANK_BATCH * WORLD_SIZE,
                                                launcher='none'))
    runner.train()
    expected = runner.val()
    got = distributed['ddp/uneven_val']
    assert got['nll'] == pytest.approx(expected['nll'], abs=TOL)
    assert got['accuracy'] == expected['accuracy']


@pytest.mark.parametrize('wrapper', ['MMFullyShardedDataParallel', 'MMFullyShard'])
def test_own_steps_with_parameters_on_the_model_itself_are_refused(wrapper):
    """Checked before wrapping (FSDPRunner.wrap_model), with what to do instead."""
    import mmfsdp
    model = contract_models.ToyGAN()
    model.scale = torch.nn.Parameter(torch.ones(1))
    from mmfsdp.wrappers.builder import resolve_wrapper
    wrapping = resolve_wrapper(dict(type=getattr(mmfsdp, wrapper)))
    with pytest.raises(ValueError, match=r"\['scale'\] belong to ToyGAN itself.*child module"):
        wrapping.layout(model)
    wrapping.layout(contract_models.ToyGAN())  # children only: fine
