"""``mmfsdp.MMFullyShard`` (FSDP2) trains what one process trains, and checkpoints like FSDP1.

Three process groups (starting interpreters is the cost):

- 2 ranks: equivalence scenarios, the tied-embedding GPT, bf16, activation
  checkpointing, checkpoints (full / sharded, resume, FSDP1 <-> FSDP2) and
  meta init from ``load_from``;
- 4 ranks: the 2-rank checkpoints resumed at 4 (one with an int
  ``reshard_after_forward``), saving again; hybrid sharding (2 x 2 mesh); meta
  init under hybrid sharding, and the memory a rank needs to build a model
  under meta init;
- 2 ranks: the checkpoints written by 4 ranks resumed at 2.

Every equivalence is checked against mmengine's *stock* ``Runner`` training the
same global batch in this process, without any mmfsdp code.
"""
import copy
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import DATASETS
from mmengine.runner import Runner
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.data import Dataset

from harness import max_abs_diff, run_distributed, scalar_history
from toy import ToyClassifier, runner_config, saved_activation_bytes

FS = 'mmfsdp.MMFullyShard'
FSDP1 = 'mmfsdp.MMFullyShardedDataParallel'
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
GPT_BLOCKS = dict(type='transformer', layer_cls=['TransformerBlock'])
TOL, SAME_WORLD_TOL = 2e-5, 1e-6
#: Checkpoints every INTERVAL iterations; runs resumed at another world size save again.
GLOBAL_BATCH, INTERVAL, TOTAL = 8, 2, 6

ADAMW = dict(optimizer=dict(type='AdamW', lr=1e-2))  # runner_config's default
CLIP = dict(optimizer=dict(type='AdamW', lr=1e-2), clip_grad=dict(max_norm=0.05))
ACCUMULATE = dict(optimizer=dict(type='AdamW', lr=1e-2), accumulative_counts=2)

#: name -> (model_wrapper_cfg, optim_wrapper, extra runner_config arguments), on 2 ranks
SCENARIOS = {
    'reshard_after_forward=False': (dict(type=FS, auto_wrap_policy=BLOCKS,
                                         reshard_after_forward=False), ADAMW, {}),
    'clip_grad': (dict(type=FS, auto_wrap_policy=BLOCKS), CLIP, {}),
    'accumulate': (dict(type=FS, auto_wrap_policy=BLOCKS), ACCUMULATE, dict(max_iters=12)),
    'activation_checkpointing': (dict(type=FS, auto_wrap_policy=BLOCKS,
                                      activation_checkpointing=dict(layer_cls=['ToyBlock'])),
                                 ADAMW, {}),
}
HYBRID = dict(type=FS, auto_wrap_policy=BLOCKS, mesh=dict(replicate=2, shard=2))
#: The 2-rank checkpoints are resumed at 4 ranks by these wrappers (the full one with an int
#: reshard_after_forward: 4 ranks are the smallest world where it means anything).
AT_4 = {'full': dict(type=FS, auto_wrap_policy=BLOCKS, reshard_after_forward=2),
        'sharded': dict(type=FS, auto_wrap_policy=BLOCKS)}
FS_BLOCKS = dict(type=FS, auto_wrap_policy=BLOCKS)
FSDP1_BLOCKS = dict(type=FSDP1, auto_wrap_policy=BLOCKS)
#: SGD for the GPT: AdamW divides by the gradients' RMS, which blows the ~1e-10 noise in
#: the gradient of the attention key bias (zero in exact arithmetic) up to lr-sized steps
#: whatever the wrapper (DDP and FSDP1 differ from one process by 6e-5 there too).
GPT_OPTIM = dict(optimizer=dict(type='SGD', lr=0.1, momentum=0.9))
BF16 = dict(type=FS, auto_wrap_policy=BLOCKS,
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32'))
BF16_ITERS = 15

# The tied-embedding GPT: wte and lm_head share one matrix.
GPT = dict(type='mmfsdp.GPT', vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)
#: A larger GPT for the memory of meta init: ~1.6 M parameters, 16 equal blocks.
BIG_GPT = dict(type='mmfsdp.GPT', vocab_size=256, block_size=16, n_layer=16, n_head=2, n_embd=96)
GPT_WRAPPERS = {
    'gpt/transformer': dict(type=FS, auto_wrap_policy=GPT_BLOCKS),
    # wte would be a unit but shares its weight with lm_head (root): merged into the root
    'gpt/merged': dict(type=FS, auto_wrap_policy=[GPT_BLOCKS, dict(type='module_types',
                                                                   module_cls=['Embedding'])]),
}


@DATASETS.register_module()
class Fsdp2TokenDataset(Dataset):
    """Token sequences with a learnable rule (arithmetic progressions mod the vocabulary)."""

    def __init__(self, length: int = 48, block_size: int = 16, vocab_size: int = 256,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab_size, (length, 1), generator=gen)
        step = torch.randint(1, 8, (length, 1), generator=gen)
        seq = (start + step * torch.arange(block_size + 1)) % vocab_size
        self.inputs, self.targets = seq[:, :-1], seq[:, 1:]

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict:
        return dict(inputs=self.inputs[i], data_samples=self.targets[i])


def _gpt_config(name: str, work_dir: str, *, batch_size: int, model: dict = GPT,
                **kwargs) -> dict:
    kwargs.setdefault('optim_wrapper', copy.deepcopy(GPT_OPTIM))
    cfg = runner_config(name, work_dir, batch_size=batch_size, **kwargs)
    cfg['model'] = copy.deepcopy(model)
    cfg['train_dataloader']['dataset'] = dict(type='Fsdp2TokenDataset')
    return cfg


class BufferedNet(nn.Module):
    """A constructor-computed buffer, restored by ``reset_parameters`` only if asked to."""

    def __init__(self, restores_buffer: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.restores_buffer = restores_buffer
        self.register_buffer('scale', torch.arange(4.0), persistent=False)

    def reset_parameters(self) -> None:
        if self.restores_buffer:
            self.scale.copy_(torch.arange(4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


class StorageBytes(TorchDispatchMode):
    """Bytes of CPU tensor storage allocated while active and still alive, and their peak.

    Every tensor an operator returns is counted once per storage until the
    storage is freed (DTensors by their local shard); views, in-place results
    and meta tensors add nothing. Deterministic, unlike the process's RSS.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):
                    self._track(inner)
            return
        if t.device.type != 'cpu':
            return
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if key in self._refs:
            return

        def freed(_, key=key, nbytes=nbytes):
            self._refs.pop(key, None)
            self.live -= nbytes

        self._refs[key] = weakref.ref(storage, freed)
        self.live += nbytes
        self.peak = max(self.peak, self.live)


# ---------------------------------------------------------------- helpers run on every rank

def _full_state(runner, optimizer: bool = False) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    options = StateDictOptions(full_state_dict=True)
    out = dict(model={k: v.detach().clone().float() for k, v in
                      get_model_state_dict(runner.model, options=options).items()},
               iter=runner.iter)
    if optimizer:
        out['optimizer'] = get_optimizer_state_dict(
            runner.model, runner.optim_wrapper.optimizer, options=options)['state']
    return out


def _train(cfg: dict, **extra) -> object:
    from mmfsdp import FSDPRunner
    cfg.update(extra)
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    return runner


def _ckpt_config(work_dir: str, wrapper: dict, world_size: int, *, state_dict_type: str = 'full',
                 resume_from: str = None) -> dict:
    cfg = runner_config(os.path.basename(work_dir), work_dir, wrapper=wrapper,
                        batch_size=GLOBAL_BATCH // world_size, max_iters=TOTAL)
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=INTERVAL,
                                              by_epoch=False, state_dict_type=state_dict_type)
    if resume_from is not None:
        cfg.update(load_from=resume_from, resume=True)
    return cfg


def _ckpt(root: str, run: str, iteration: int = INTERVAL) -> str:
    return os.path.join(root, run, f'iter_{iteration}.pth')


def _train_ckpt(root: str, run: str, wrapper: dict, world_size: int, **kwargs) -> dict:
    runner = _train(_ckpt_config(f'{root}/{run}', wrapper, world_size, **kwargs))
    return _full_state(runner, optimizer=True)


def _meta_buffers(root: str) -> dict:
    """Buffers under meta init: restored, lost, and the data preprocessor's."""
    from mmfsdp import FSDPRunner, MMFullyShard
    out = {}
    for restores in (True, False):
        with torch.device('meta'):
            model = BufferedNet(restores)
        try:
            wrapped = MMFullyShard.from_options(model, init_device='meta')
            out[restores] = wrapped.module.scale.clone()
        except RuntimeError as e:
            out[restores] = str(e)
    cfg = runner_config('meta-preprocessor', f'{root}/meta-preprocessor', batch_size=4,
                        wrapper=dict(FS_BLOCKS, init_device='meta'))
    cfg['model']['data_preprocessor'] = dict(type='ImgDataPreprocessor', mean=[1.0, 2.0, 3.0],
                                             std=[4.0, 5.0, 6.0])
    preprocessor = FSDPRunner.from_cfg(Config(cfg)).model.module.data_preprocessor
    out['preprocessor'] = (preprocessor.mean.flatten().tolist(),
                           preprocessor.std.flatten().tolist())
    return out


def _local_shards(runner, name: str) -> list:
    """Every rank's local shard of parameter ``name`` (collective)."""
    param = dict(runner.model.module.named_parameters())[name]
    local = param.to_local().detach().clone()
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)
    return gathered


def _two_ranks(root: str) -> dict:
    import mmfsdp  # noqa: F401  (registers the 'mmfsdp.' names)
    from mmfsdp import FSDPRunner, MMFullyShard
    out = {}
    for name, (wrapper, optim, extra) in SCENARIOS.items():
        cfg = runner_config(name, f'{root}/{name}', wrapper=wrapper, batch_size=4,
                            optim_wrapper=optim, **extra)
        runner = _train(cfg)
        out[name] = dict(_full_state(runner), grad_norm=scalar_history(runner, 'train/grad_norm'))

    for name, wrapper in GPT_WRAPPERS.items():
        cfg = _gpt_config(name, f'{root}/{name}', batch_size=4, wrapper=wrapper)
        cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=INTERVAL,
                                                  by_epoch=False)
        runner = _train(cfg)
        gpt = runner.model.module
        out[name] = dict(_full_state(runner), units=list(runner.model.units),
                         tied=gpt.wte.weight is gpt.lm_head.weight)
    # Meta init: the GPT built on the meta device, weights from a full checkpoint,
    # against the same checkpoint loaded into the eagerly built GPT.
    start = _ckpt(root, 'gpt/transformer')
    for name, init_device in (('meta/load_from', 'meta'), ('eager/load_from', None)):
        wrapper = dict(GPT_WRAPPERS['gpt/transformer'], init_device=init_device)
        runner = _train(_gpt_config(name, f'{root}/{name}', batch_size=4, wrapper=wrapper,
                                    max_iters=2), load_from=start)
        gpt = runner.model.module
        out[name] = dict(_full_state(runner), tied=gpt.wte.weight is gpt.lm_head.weight)
    # Meta init from init_weights alone: every shard drawn independently.
    wrapper = dict(GPT_WRAPPERS['gpt/transformer'], init_device='meta')
    runner = FSDPRunner.from_cfg(Config(_gpt_config('meta/init', f'{root}/meta-init',
                                                    batch_size=4, wrapper=wrapper)))
    out['meta/init'] = dict(model=_full_state(runner)['model'],
                            shards=_local_shards(runner, 'blocks.0.mlp.fc.weight'))
    out['meta/buffers'] = _meta_buffers(root)

    runner = _train(runner_config('bf16', f'{root}/bf16', wrapper=BF16, batch_size=4,
                                  max_iters=BF16_ITERS))
    out['bf16'] = dict(loss=scalar_history(runner, 'train/loss'),
                       dtypes=sorted({str(p.dtype) for p in runner.model.parameters()}))
    out['activation_bytes'] = {
        name: saved_activation_bytes(MMFullyShard, checkpoint)
        for name, checkpoint in (('plain', False), ('checkpointed', True))}

    # Checkpoints: FSDP2 full and sharded, resumed at 2 ranks; FSDP1 <-> FSDP2.
    for kind in ('full', 'sharded'):
        run = f'fs-{kind}'
        out[f'uninterrupted/{run}'] = _train_ckpt(root, run, FS_BLOCKS, 2, state_dict_type=kind)
        out[f'resumed/{run}'] = _train_ckpt(root, f'{run}-resumed', FS_BLOCKS, 2,
                                            resume_from=_ckpt(root, run))
    out['uninterrupted/fsdp1-full'] = _train_ckpt(root, 'fsdp1-full', FSDP1_BLOCKS, 2)
    out['fsdp1->fs'] = _train_ckpt(root, 'fsdp1-to-fs', FS_BLOCKS, 2,
                                   resume_from=_ckpt(root, 'fsdp1-full'))
    out['fs->fsdp1'] = _train_ckpt(root, 'fs-to-fsdp1', FSDP1_BLOCKS, 2,
                                   resume_from=_ckpt(root, 'fs-full'))
    return out if torch.distributed.get_rank() == 0 else None


def _hybrid_layout(runner) -> list:
    """(mesh shape, placements, local rows, global rows) of every parameter."""
    return [(tuple(p.device_mesh.shape), str(p.placements), p.to_local().shape[0], p.shape[0])
            for p in runner.model.parameters()]


def _construction_bytes(cfg: dict) -> int:
    """Peak CPU tensor bytes this rank allocates while the runner builds (and shards) the model."""
    from mmfsdp import FSDPRunner
    with StorageBytes() as tracker:
        runner = FSDPRunner.from_cfg(Config(cfg))
    del runner
    return tracker.peak


def _four_ranks(root: str) -> dict:
    import mmfsdp  # noqa: F401
    from mmfsdp import FSDPRunner
    out = {}
    for kind, wrapper in AT_4.items():
        out[f'2to4/{kind}'] = _train_ckpt(root, f'fs-{kind}-at4', wrapper, 4,
                                          resume_from=_ckpt(root, f'fs-{kind}'))
    runner = _train(runner_config('hybrid', f'{root}/hybrid', wrapper=HYBRID, batch_size=2))
    out['hybrid'] = dict(_full_state(runner), layout=_hybrid_layout(runner))

    # Meta init with hybrid sharding: replicas of a shard agree, shards differ.
    wrapper = dict(type=FS, auto_wrap_policy=GPT_BLOCKS, mesh=dict(replicate=2, shard=2),
                   init_device='meta')
    runner = FSDPRunner.from_cfg(Config(_gpt_config('meta-hybrid', f'{root}/meta-hybrid',
                                                    batch_size=2, wrapper=wrapper)))
    out['meta/hybrid shards'] = _local_shards(runner, 'blocks.0.mlp.fc.weight')
    del runner

    # What one rank allocates to build the larger GPT: eagerly, then under meta init.
    memory = {}
    for init_device in (None, 'meta'):
        wrapper = dict(type=FS, auto_wrap_policy=GPT_BLOCKS, init_device=init_device)
        cfg = _gpt_config(f'memory-{init_device}', f'{root}/memory-{init_device}',
                          batch_size=2, wrapper=wrapper, model=BIG_GPT)
        memory[str(init_device)] = _construction_bytes(cfg)
    gathered = [None] * 4
    torch.distributed.all_gather_object(gathered, memory)
    out['memory'] = gathered
    return out if torch.distributed.get_rank() == 0 else None


def _back_to_two_ranks(root: str) -> dict:
    import mmfsdp  # noqa: F401
    out = {}
    for kind in AT_4:  # saved at iteration 4 by the runs resumed at 4 ranks
        out[f'4to2/{kind}'] = _train_ckpt(root, f'fs-{kind}-at4-at2', FS_BLOCKS, 2,
                                          resume_from=_ckpt(root, f'fs-{kind}-at4', 4))
    return out if torch.distributed.get_rank() == 0 else None


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope='module')
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('fsdp2'))


@pytest.fixture(scope='module')
def runs(root) -> dict:
    results = run_distributed(_two_ranks, 2, root, timeout=400)[0]
    results.update(run_distributed(_four_ranks, 4, root, timeout=400)[0])
    results.update(run_distributed(_back_to_two_ranks, 2, root)[0])
    return results


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """Single-process runs with mmengine's stock Runner, memoised per setting."""
    cache = {}
    base = tmp_path_factory.mktemp('ref')

    def run(optim_wrapper: dict = ADAMW, extra: dict = None, gpt: bool = False) -> dict:
        optim_wrapper = GPT_OPTIM if gpt else optim_wrapper
        extra = extra or {}
        key = repr((optim_wrapper, extra, gpt))
        if key not in cache:
            accumulate = optim_wrapper.get('accumulative_counts', 1)
            single = {k: v for k, v in optim_wrapper.items() if k != 'accumulative_counts'}
            kwargs = dict(launcher='none', batch_size=GLOBAL_BATCH * accumulate,
                          optim_wrapper=copy.deepcopy(single),
                          max_iters=extra.get('max_iters', TOTAL) // accumulate)
            work_dir = str(base / str(len(cache)))
            cfg = (_gpt_config(f'ref{len(cache)}', work_dir, **kwargs) if gpt else
                   runner_config(f'ref{len(cache)}', work_dir, **kwargs))
            runner = Runner.from_cfg(Config(cfg))
            runner.train()
            cache[key] = dict(model={k: v.detach().clone() for k, v in
                                     runner.model.state_dict().items()},
                              grad_norm=scalar_history(runner, 'train/grad_norm'))
        return cache[key]

    return run


def _assert_close(name: str, got: dict, expected: dict, tol: float) -> None:
    diff = max_abs_diff(got, expected)
    print(f'{name}: max abs diff {diff:.1e}')
    assert diff <= tol


# ---------------------------------------------------------------- equivalence with one process

@pytest.mark.parametrize('name', list(SCENARIOS))
def test_final_weights_equal_one_process(runs, reference, name):
    _, optim, extra = SCENARIOS[name]
    _assert_close(name, runs[name]['model'], reference(optim, extra)['model'], TOL)


def test_reshard_after_forward_true_equals_one_process(runs, reference):
    # The uninterrupted run behind the full checkpoints: default reshard_after_forward=True.
    _assert_close('reshard_after_forward=True', runs['uninterrupted/fs-full']['model'],
                  reference()['model'], TOL)


def test_clipping_logs_the_global_gradient_norm(runs, reference):
    logged = runs['clip_grad']['grad_norm']
    expected = reference(CLIP)['grad_norm']
    assert len(logged) == len(expected) == TOTAL
    assert logged == pytest.approx(expected, rel=1e-4)
    assert min(expected) > CLIP['clip_grad']['max_norm']  # clipping was active


@pytest.mark.parametrize('name', list(GPT_WRAPPERS))
def test_tied_embedding_gpt_trains_like_one_process(runs, reference, name):
    got = runs[name]
    assert got['tied']  # still one parameter after sharding
    _assert_close(name, got['model'], reference(gpt=True)['model'], TOL)


def test_shared_parameter_merges_its_units_into_the_root(runs):
    assert runs['gpt/transformer']['units'] == ['blocks.0', 'blocks.1']
    # wte shares its weight with the root's lm_head: not a unit; wpe still is
    assert runs['gpt/merged']['units'] == ['wpe', 'blocks.0', 'blocks.1']


def test_hybrid_sharding_equals_one_process(runs, reference):
    _assert_close('hybrid 2x2', runs['hybrid']['model'], reference()['model'], TOL)


def test_hybrid_sharding_shards_over_two_ranks_not_four(runs):
    layout = runs['hybrid']['layout']
    assert layout and all(mesh == (2, 2) for mesh, *_ in layout)
    assert all(placements == '(Replicate(), Shard(dim=0))' for _, placements, *_ in layout)
    assert all(local == math.ceil(rows / 2) for *_, local, rows in layout)


def test_bf16_mixed_precision_trains_on_cpu(runs):
    loss = runs['bf16']['loss']
    assert len(loss) == BF16_ITERS and all(math.isfinite(v) for v in loss)
    first, last = sum(loss[:5]) / 5, sum(loss[-5:]) / 5
    print(f'bf16 loss: first five {first:.3f}, last five {last:.3f}')
    assert last < 0.8 * first
    assert runs['bf16']['dtypes'] == ['torch.float32']  # fp32 sharded master weights


def test_activation_checkpointing_lowers_activation_memory(runs):
    saved = runs['activation_bytes']
    print(f'saved activations: {saved}')
    assert saved['checkpointed'] < 0.5 * saved['plain']


# ---------------------------------------------------------------- checkpoints

@pytest.mark.parametrize('kind', ['full', 'sharded'])
def test_resume_equals_uninterrupted_training(runs, kind):
    expected = runs[f'uninterrupted/fs-{kind}']
    got = runs[f'resumed/fs-{kind}']
    assert got['iter'] == expected['iter'] == TOTAL
    _assert_close(f'resume {kind}', got['model'], expected['model'], SAME_WORLD_TOL)
    _assert_close(f'resume {kind} optimizer', got['optimizer'], expected['optimizer'],
                  SAME_WORLD_TOL)


@pytest.mark.parametrize('run', ['2to4/full', '2to4/sharded', '4to2/full', '4to2/sharded'])
def test_checkpoints_reshard_between_2_and_4_ranks(runs, run):
    expected = runs['uninterrupted/fs-full']
    _assert_close(run, runs[run]['model'], expected['model'], TOL)
    _assert_close(f'{run} optimizer', runs[run]['optimizer'], expected['optimizer'], TOL)


@pytest.mark.parametrize('run, expected', [('fsdp1->fs', 'uninterrupted/fsdp1-full'),
                                           ('fs->fsdp1', 'uninterrupted/fs-full')])
def test_full_checkpoints_move_between_fsdp1_and_fsdp2(runs, run, expected):
    _assert_close(run, runs[run]['model'], runs[expected]['model'], TOL)
    _assert_close(f'{run} optimizer', runs[run]['optimizer'], runs[expected]['optimizer'], TOL)


def test_full_checkpoint_loads_strictly_into_the_plain_model(runs, root):
    from mmengine.runner import load_checkpoint
    model = ToyClassifier()
    load_checkpoint(model, _ckpt(root, 'fs-full', TOTAL), strict=True)
    expected = runs['uninterrupted/fs-full']['model']
    _assert_close('plain load', model.state_dict(), expected, 0)


def test_consolidated_sharded_checkpoint_equals_the_full_one(runs, root, tmp_path):
    dst = str(tmp_path / 'consolidated.pth')
    subprocess.run([sys.executable, '-m', 'mmfsdp.consolidate', _ckpt(root, 'fs-sharded'), dst],
                   check=True)
    consolidated, full = torch.load(dst), torch.load(_ckpt(root, 'fs-full'))
    assert max_abs_diff(consolidated['state_dict'], full['state_dict']) == 0
    assert max_abs_diff(consolidated['optimizer']['state'], full['optimizer']['state']) == 0


# ---------------------------------------------------------------- meta init

def test_meta_init_from_load_from_equals_eager_construction(runs):
    meta, eager = runs['meta/load_from'], runs['eager/load_from']
    assert meta['tied'] and eager['tied']
    _assert_close('meta vs eager, load_from', meta['model'], eager['model'], 0)


def test_meta_init_draws_every_shard_independently(runs):
    shards = runs['meta/init']['shards']
    assert shards[0].shape == shards[1].shape and not torch.equal(shards[0], shards[1])
    weight = torch.cat(shards)
    assert 0.015 < weight.std().item() < 0.025  # GPT's N(0, 0.02)
    model = runs['meta/init']['model']
    assert torch.equal(model['wte.weight'], model['lm_head.weight'])
    assert torch.equal(model['blocks.0.ln_1.weight'], torch.ones(32))


def test_meta_init_replicas_agree_and_shards_differ_under_hybrid_sharding(runs):
    # ranks 0, 1 form the first shard group, 2, 3 the second (replicate x shard)
    shards = runs['meta/hybrid shards']
    assert torch.equal(shards[0], shards[2]) and torch.equal(shards[1], shards[3])
    assert not torch.equal(shards[0], shards[1])


def test_meta_init_restores_or_reports_constructor_buffers(runs):
    buffers = runs['meta/buffers']
    assert torch.equal(buffers[True], torch.arange(4.0))
    assert 'BufferedNet: scale' in buffers[False]  # no value recorded under torch.device('meta')
    assert 'give `BufferedNet` a `reset_parameters`' in buffers[False]
    assert buffers['preprocessor'] == ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])


def test_meta_init_keeps_construction_memory_near_one_shard(runs):
    from mmfsdp.demo import GPT as GPTModel
    model = GPTModel(**{k: v for k, v in BIG_GPT.items() if k != 'type'})
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    shard = full / 4
    for rank, memory in enumerate(runs['memory']):
        print(f'rank {rank}: full model {full / 2**20:.2f} MiB, one shard '
              f'{shard / 2**20:.2f} MiB; peak while building: eager '
              f'{memory["None"] / 2**20:.2f} MiB, meta init {memory["meta"] / 2**20:.2f} MiB')
        assert memory['None'] >= full
        assert memory['meta'] <= 1.1 * shard + 2**16  # the shard, padding, small buffers


def _reduced_gradients() -> dict:
    """The averaged gradient of a weight whose gradients, 1 and 2**-8, sum exactly only in fp32."""
    from harness import DIST_CFG
    from mmfsdp import MMFullyShard
    from mmfsdp.dist import init_distributed
    init_distributed('pytorch', DIST_CFG)
    out = {}
    for name, mixed_precision in (('unset', dict(param_dtype='bf16')),
                                  ('fp32', dict(param_dtype='bf16', reduce_dtype='fp32'))):
        model = MMFullyShard.from_options(nn.Linear(1, 1, bias=False),
                                          mixed_precision=mixed_precision).module
        x = torch.full((1, 1), 1.0 if torch.distributed.get_rank() == 0 else 2.0**-8)
        model(x).sum().backward()  # this rank's gradient of the weight is x, exact in bf16
        out[name] = model.weight.grad.full_tensor().item()
    return out


@pytest.mark.smoke
def test_an_unset_reduce_dtype_reduces_in_param_dtype_on_every_torch():
    """``param_dtype='bf16'`` alone reduce-scatters in bf16, as FSDP1 and torch 2.13 do (torch
    2.15's FSDP2 alone would reduce in fp32): (1 + 2**-8) / 2 rounds to 0.5 in bf16."""
    for rank in run_distributed(_reduced_gradients, 2):
        assert rank == dict(unset=0.5, fp32=(1 + 2**-8) / 2), \
            f'{rank} (torch {torch.__version__}; resolve_mp_policy no longer sets reduce_dtype)'
