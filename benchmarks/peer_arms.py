"""The arms of the peers benchmark: one training loop per framework, all on the same model.

An *arm* trains the demo GPT (:class:`PeerGPT`: same preset, same initial
weights read from one file) with AdamW, one FSDP unit per ``TransformerBlock``
where the framework shards, on batches that the caller passes in. Every arm is
built the way that framework's documentation shows, with the settings of its
hand-written torch counterpart (its *family*):

- ``torch FSDP1`` / ``torch FSDP2`` / ``torch DDP``: :func:`benchmarks.workload.plain_model`;
- ``mmfsdp FSDP1`` / ``FSDP2`` / ``DDP``: ``FSDPRunner`` with the mmfsdp wrapper, one
  iteration of its own train loop per step (hooks, data preprocessor,
  ``train_step``, ``OptimWrapper``);
- ``accelerate FSDP1`` / ``FSDP2``: ``Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(
  fsdp_version=1|2, ...))``, ``prepare(model, optimizer)``, ``accelerator.backward``;
- ``Fabric FSDPStrategy`` / ``Fabric ModelParallelStrategy``: Lightning Fabric,
  ``setup_module`` then the optimizer, ``fabric.backward``;
- ``mmengine FlexibleRunner FSDP``: ``FlexibleRunner`` with mmengine's own ``FSDPStrategy``.

Nothing here imports accelerate or lightning until an arm of theirs is built:
they are optional (the ``benchmarks`` extra).
"""
import gc
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.registry import LOOPS
from mmengine.runner import IterBasedTrainLoop

from mmfsdp.demo import GPT
from mmfsdp.registry import MODELS as MMFSDP_MODELS

from .workload import BLOCK_SIZE, LR, MODELS, STRATEGIES, VOCAB_SIZE, make_runner, plain_model
from .workload import runner_cfg as mmfsdp_runner_cfg

__all__ = ['ARMS', 'FAMILIES', 'SEED', 'Arm', 'PeerGPT', 'Trainer', 'build']

#: Every arm seeds its random number generators with this, the way its framework documents
#: (``torch.manual_seed``, mmengine's ``randomness``, accelerate's ``set_seed``, Fabric's
#: ``seed_everything``), as the training scripts being compared do. The weights come from a
#: file and the model has no dropout, so the seed changes no number; it is there because
#: seeding has a cost of its own: torch keeps the caller's formatted stack for a lazy CUDA
#: seed, and from the second call in a process that stack reads torch/_dynamo/eval_frame.py
#: into ``linecache`` (0.27 MiB), which an arm that does not seed would not pay.
SEED = 0

#: Numbers the runners a process builds. mmengine names a runner's logger and visualizer
#: ``experiment_name + '_' + timestamp`` and reuses an instance of that name: two runners built
#: within one second would share the first one's, whose directory an earlier case deleted
#: (seen: rank 0 alone failing to write its config there, and the job hanging).
_BUILDS = itertools.count()


def experiment_name(label: str) -> str:
    """A name no earlier runner of this process had (the same on every rank)."""
    return f"peers-{label.replace(' ', '-')}-{next(_BUILDS)}"


#: The hand-written torch arm every other arm of a family is timed against.
FAMILIES: Dict[str, str] = {'fsdp1': 'torch FSDP1', 'fsdp2': 'torch FSDP2', 'ddp': 'torch DDP'}


@MMFSDP_MODELS.register_module(name='BenchmarkPeerGPT')
class PeerGPT(GPT):
    """The demo GPT whose ``init_weights`` loads the shared initial weights from ``init_file``.

    Every framework initialises through ``init_weights`` (or the caller calls it
    before wrapping), so all arms start from the same tensors without any
    framework's own loading path.
    """

    def __init__(self, init_file: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init_file = init_file

    def init_weights(self) -> None:
        """Copy the shared initial weights in."""
        self.load_state_dict(torch.load(self.init_file, weights_only=True))


def peer_model_cfg(preset: str, init_file: str) -> Dict[str, Any]:
    """The mmengine config of :class:`PeerGPT` for ``preset``."""
    return dict(type='mmfsdp.BenchmarkPeerGPT', init_file=init_file, vocab_size=VOCAB_SIZE,
                block_size=BLOCK_SIZE, **MODELS[preset])


def write_init_file(preset: str, path: str, seed: int = 0) -> None:
    """Write the initial weights of ``preset`` (the GPT's own init under ``seed``)."""
    torch.manual_seed(seed)
    model = GPT(VOCAB_SIZE, BLOCK_SIZE, **MODELS[preset])
    model.init_weights()
    torch.save(model.state_dict(), path)


def _model(preset: str, init_file: str) -> PeerGPT:
    model = PeerGPT(init_file, vocab_size=VOCAB_SIZE, block_size=BLOCK_SIZE, **MODELS[preset])
    model.init_weights()
    return model


def _loss(module: Any, batch: Dict[str, Any]) -> torch.Tensor:
    return module(batch['inputs'], batch['data_samples'], mode='loss')['loss']


@dataclass
class Trainer:
    """A built arm: ``step(batch)`` trains one step and returns the loss of this rank.

    ``module`` and ``optimizer`` (the torch optimizer underneath any framework
    wrapper) are what the model-state probe counts; ``close`` releases the arm.
    """

    step: Callable[[Dict[str, Any]], float]
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    close: Callable[[], None] = lambda: None
    #: What the framework decided, in its own words (e.g. accelerate's distributed type).
    notes: str = ''


@dataclass(frozen=True)
class Arm:
    """One framework configuration of the benchmark."""

    label: str
    family: str
    build: Callable[[str, str, str], Trainer]
    #: What the arm asks the framework for, in words (the report's "settings" column).
    settings: str


def _plain(kind: str) -> Callable[[str, str, str], Trainer]:
    def build(preset: str, init_file: str, work_dir: str) -> Trainer:
        torch.manual_seed(SEED)
        model, optimizer = plain_model(kind, preset, model=_model(preset, init_file))

        def step(batch: Dict[str, Any]) -> float:
            loss = _loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        return Trainer(step, model, optimizer)
    return build


@LOOPS.register_module(name='BenchmarkPeersLoop')
class PeersLoop(IterBasedTrainLoop):
    """A train loop that only starts: the benchmark then calls :meth:`step` round by round.

    ``run`` calls the hooks that precede the first iteration and returns, so the
    runner finishes its ``train()`` set-up (wrapping, optimizer, weights) and the
    caller drives the iterations, interleaved with the other arms.
    """

    def __init__(self, runner: Any, dataloader: Any, **kwargs: Any) -> None:
        super().__init__(runner, dataloader, max_iters=10**6, **kwargs)

    def run(self) -> Any:
        """Start training, run no iteration."""
        self.runner.call_hook('before_train')
        self.runner.call_hook('before_train_epoch')
        self.runner.model.train()
        return self.runner.model


class _LossProbe(Hook):
    """Keeps the loss of the last iteration (the runner's ``train_step`` output)."""

    loss = float('nan')

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        self.loss = outputs['loss'].item()


def _runner_trainer(runner: Any) -> Trainer:
    probe = _LossProbe()
    runner.register_hook(probe, priority='VERY_LOW')
    runner.train()  # PeersLoop: set-up only

    def step(batch: Dict[str, Any]) -> float:
        runner.train_loop.run_iter(batch)
        return probe.loss

    return Trainer(step, runner.model, runner.optim_wrapper.optimizer)


def _mmfsdp(label: str) -> Callable[[str, str, str], Trainer]:
    def build(preset: str, init_file: str, work_dir: str) -> Trainer:
        cfg = mmfsdp_runner_cfg(preset, STRATEGIES[label].wrapper_cfg, work_dir,
                                experiment_name(label), 1, 16, 0,
                                train_cfg=dict(type='BenchmarkPeersLoop'))
        cfg.model = peer_model_cfg(preset, init_file)
        cfg.randomness = dict(seed=SEED)
        cfg.train_dataloader = _train_dataloader()
        # Equal settings: every arm allocates as the job's environment says (Method).
        return _runner_trainer(make_runner(cfg))
    return build


def _train_dataloader() -> Dict[str, Any]:
    """The runner arms' dataloader: built (their loops need one), never iterated.

    Batches come from the caller, made before the baseline for every arm, so
    the dataset holds 1 KiB of text: the runner arms do not pay for a dataset
    that the plain loops have no part of.
    """
    return dict(dataset=dict(type='mmfsdp.StdlibCharDataset', block_size=16, max_chars=1024),
                sampler=dict(type='DefaultSampler', shuffle=False),
                collate_fn=dict(type='default_collate'), batch_size=1, num_workers=0)


def _flexible(cpu_device_id: bool) -> Callable[[str, str, str], Trainer]:
    def build(preset: str, init_file: str, work_dir: str) -> Trainer:
        return _flexible_runner(preset, init_file, work_dir, cpu_device_id)
    return build


def _flexible_runner(preset: str, init_file: str, work_dir: str,
                     cpu_device_id: bool) -> Trainer:
    from mmengine.runner import FlexibleRunner
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from mmfsdp.demo import TransformerBlock
    wrapper = dict(type='MMFullyShardedDataParallel', sharding_strategy='FULL_SHARD',
                   auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                   backward_prefetch='BACKWARD_PRE', limit_all_gathers=True,
                   use_orig_params=True)
    if cpu_device_id:  # FSDPStrategy's default is device_id=int(LOCAL_RANK): an accelerator
        wrapper['device_id'] = torch.device('cpu')
    runner = FlexibleRunner(
        model=peer_model_cfg(preset, init_file), work_dir=work_dir,
        strategy=dict(type='FSDPStrategy', model_wrapper=wrapper),
        optim_wrapper=dict(type='OptimWrapper', optimizer=dict(type='AdamW', lr=LR)),
        train_dataloader=_train_dataloader(), train_cfg=dict(type='BenchmarkPeersLoop'),
        default_hooks=dict(checkpoint=None, logger=dict(type='LoggerHook', interval=10**6)),
        launcher='pytorch', env_cfg=dict(dist_cfg=dict(backend='gloo')),
        log_level='WARNING', randomness=dict(seed=SEED),
        experiment_name=experiment_name('FlexibleRunner FSDP'))
    return _runner_trainer(runner)


def _accelerate(version: int) -> Callable[[str, str, str], Trainer]:
    def build(preset: str, init_file: str, work_dir: str) -> Trainer:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import FullyShardedDataParallelPlugin, set_seed

        # Accelerator state is one per process; the benchmark builds two Accelerators
        # (FSDP1, FSDP2 plugins) in one process, so the first one's must go.
        AcceleratorState._reset_state()
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=version, auto_wrap_policy='transformer_based_wrap',
            transformer_cls_names_to_wrap=['TransformerBlock'],
            reshard_after_forward=True if version == 2 else 'FULL_SHARD',
            backward_prefetch='BACKWARD_PRE' if version == 1 else None,
            limit_all_gathers=True, use_orig_params=True, sync_module_states=False,
            state_dict_type='SHARDED_STATE_DICT')
        # cpu=True: accelerate's documented CPU switch. Without it, on a machine without an
        # accelerator, it picks DistributedType.NO under torchrun: no wrapper at all.
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        set_seed(SEED)
        model = _model(preset, init_file)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)

        def step(batch: Dict[str, Any]) -> float:
            loss = _loss(model, batch)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        state = accelerator.state
        plugin_kept = getattr(state, 'fsdp_plugin', None) is not None
        return Trainer(step, model, optimizer.optimizer, accelerator.free_memory,
                       notes=f'distributed_type={state.distributed_type.value}, '
                       f'fsdp_plugin {"kept" if plugin_kept else "dropped"}')
    return build


def _fully_shard_blocks(model: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
    """Fabric ModelParallelStrategy's ``parallelize_fn``: FSDP2 per block, then the root."""
    from torch.distributed.fsdp import fully_shard
    mesh = device_mesh['data_parallel']
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fabric(kind: str) -> Callable[[str, str, str], Trainer]:
    def build(preset: str, init_file: str, work_dir: str) -> Trainer:
        from lightning.fabric import Fabric
        from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
        from torch.distributed.fsdp import BackwardPrefetch

        from mmfsdp.demo import TransformerBlock
        world = dist.get_world_size()
        if kind == 'fsdp1':
            strategy: Any = FSDPStrategy(
                auto_wrap_policy={TransformerBlock}, sharding_strategy='FULL_SHARD',
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True,
                use_orig_params=True)
        else:
            strategy = ModelParallelStrategy(parallelize_fn=_fully_shard_blocks,
                                             data_parallel_size=world, tensor_parallel_size=1)
        fabric = Fabric(accelerator='cpu', devices=world, num_nodes=1, strategy=strategy)
        fabric.launch()
        fabric.seed_everything(SEED)
        model = fabric.setup_module(_model(preset, init_file))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))

        def step(batch: Dict[str, Any]) -> float:
            loss = _loss(model, batch)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        return Trainer(step, model, optimizer.optimizer)
    return build


ARMS: Dict[str, Arm] = {a.label: a for a in (
    Arm('torch FSDP1', 'fsdp1', _plain('fsdp1'),
        'FullyShardedDataParallel FULL_SHARD, BACKWARD_PRE, limit_all_gathers, use_orig_params'),
    Arm('torch FSDP2', 'fsdp2', _plain('fsdp2'), 'fully_shard per block, then the root'),
    Arm('torch DDP', 'ddp', _plain('ddp'),
        'DistributedDataParallel, gradient_as_bucket_view, no buffer broadcast'),
    Arm('mmfsdp FSDP1', 'fsdp1', _mmfsdp('FSDP1 FULL_SHARD'),
        "FSDPRunner, MMFullyShardedDataParallel FULL_SHARD, policy 'transformer'"),
    Arm('mmfsdp FSDP2', 'fsdp2', _mmfsdp('FSDP2 reshard'),
        "FSDPRunner, MMFullyShard reshard_after_forward=True, policy 'transformer'"),
    Arm('mmfsdp DDP', 'ddp', _mmfsdp('DDP'), 'FSDPRunner, MMDistributedDataParallel'),
    Arm('accelerate FSDP1', 'fsdp1', _accelerate(1),
        'FullyShardedDataParallelPlugin(fsdp_version=1, FULL_SHARD, transformer_based_wrap)'),
    Arm('accelerate FSDP2', 'fsdp2', _accelerate(2),
        'FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, '
        'transformer_based_wrap)'),
    Arm('Fabric FSDPStrategy', 'fsdp1', _fabric('fsdp1'),
        "FSDPStrategy(FULL_SHARD, auto_wrap_policy={TransformerBlock}), accelerator='cpu'"),
    Arm('Fabric ModelParallelStrategy', 'fsdp2', _fabric('fsdp2'),
        "ModelParallelStrategy(parallelize_fn=fully_shard per block, data_parallel_size=N), "
        "accelerator='cpu'"),
    Arm('mmengine FlexibleRunner FSDP', 'fsdp1', _flexible(False),
        'FlexibleRunner, FSDPStrategy(model_wrapper=MMFullyShardedDataParallel FULL_SHARD, '
        'ModuleWrapPolicy({TransformerBlock}))'),
    Arm('mmengine FlexibleRunner FSDP, device_id=cpu', 'fsdp1', _flexible(True),
        "as above, plus model_wrapper device_id=torch.device('cpu')"),
)}


def build(label: str, preset: str, init_file: str, work_dir: str) -> Trainer:
    """Build the arm ``label``."""
    return ARMS[label].build(preset, init_file, work_dir)


def release(trainer: Optional[Trainer]) -> None:
    """Let an arm's memory go."""
    if trainer is not None:
        trainer.close()
    gc.collect()


def wrapper_name(module: Any) -> str:
    """The class that wraps the model (under Fabric's own module wrapper)."""
    inner = getattr(module, '_forward_module', module)
    return type(inner).__name__


def labels() -> List[str]:
    """Every arm, in the benchmark's order."""
    return list(ARMS)
