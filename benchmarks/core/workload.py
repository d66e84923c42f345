"""The workload the benchmarks share: GPT presets, strategies, runner configs, plain loops.

A *strategy* is one ``model_wrapper_cfg`` of mmfsdp together with its theory:
model-state bytes per rank and communication bytes per rank per step as
functions of the parameter count P, the world size N and b = 4 bytes per fp32
element.
"""
import gc
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from .measure import rss_bytes

#: GPT presets of the demo model (vocabulary of 256 bytes, tied embedding).
MODELS: Dict[str, Dict[str, int]] = {
    'gpt-tiny': dict(n_layer=2, n_embd=64, n_head=2),  # 0.1M parameters: smoke tests, warm-ups
    'gpt-7m': dict(n_layer=4, n_embd=384, n_head=6),  # 7.2M: quick runs
    'gpt-25m': dict(n_layer=8, n_embd=512, n_head=8),  # 25.4M
    'gpt-100m': dict(n_layer=14, n_embd=768, n_head=12),  # 99.5M
}
VOCAB_SIZE = 256
BLOCK_SIZE = 128
#: The unit of every FSDP plan here: one per transformer block (plus the root).
POLICY = dict(type='transformer', layer_cls=['TransformerBlock'])
#: ``activation_checkpointing`` of the cases that checkpoint every block.
CHECKPOINT_BLOCKS = dict(layer_cls=['TransformerBlock'])
LR = 1e-4
BYTES_PER_ELEMENT = 4  # fp32 parameters, gradients and AdamW moments


@dataclass(frozen=True)
class Strategy:
    """A wrapper configuration and what theory says it costs."""

    label: str
    wrapper_cfg: Dict[str, Any]
    #: Model-state bytes per rank per parameter, as a function of N (fp32 AdamW: 16 in all).
    state_bytes_per_param: Callable[[int], float]
    state_bound: str
    #: Communication bytes per rank per step, as a multiple of P * b, as a function of N.
    comm_factor: Callable[[int], float]
    comm_formula: str


def fsdp1_cfg(sharding_strategy: str = 'FULL_SHARD') -> Dict[str, Any]:
    """mmfsdp's FSDP1 wrapper, one unit per block."""
    return dict(type='mmfsdp.MMFullyShardedDataParallel', sharding_strategy=sharding_strategy,
                auto_wrap_policy=POLICY)


def fsdp2_cfg(reshard: bool = True) -> Dict[str, Any]:
    """mmfsdp's FSDP2 wrapper, one unit per block."""
    return dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=POLICY,
                reshard_after_forward=reshard)


def zero3(n: int) -> float:
    return 16 / n


def zero2(n: int) -> float:
    return 4 + 12 / n


def replicated(n: int) -> float:
    return 16.0


def two_passes(n: int) -> float:
    return 2 * (n - 1) / n


def three_passes(n: int) -> float:
    return 3 * (n - 1) / n


STRATEGIES: Dict[str, Strategy] = {s.label: s for s in (
    Strategy('DDP', dict(type='mmfsdp.MMDistributedDataParallel'), replicated, '16P',
             two_passes, '2(N-1)/N·P·b'),
    Strategy('FSDP1 FULL_SHARD', fsdp1_cfg('FULL_SHARD'), zero3, '16P/N', three_passes,
             '3(N-1)/N·P·b'),
    Strategy('FSDP1 SHARD_GRAD_OP', fsdp1_cfg('SHARD_GRAD_OP'), zero2, '4P+12P/N', two_passes,
             '2(N-1)/N·P·b'),
    Strategy('FSDP1 NO_SHARD', fsdp1_cfg('NO_SHARD'), replicated, '16P', two_passes,
             '2(N-1)/N·P·b'),
    Strategy('FSDP2 reshard', fsdp2_cfg(True), zero3, '16P/N', three_passes, '3(N-1)/N·P·b'),
    Strategy('FSDP2 no-reshard', fsdp2_cfg(False), zero2, '4P+12P/N', two_passes,
             '2(N-1)/N·P·b'),
)}


def model_cfg(preset: str) -> Dict[str, Any]:
    """The mmengine config of a GPT preset."""
    return dict(type='mmfsdp.GPT', vocab_size=VOCAB_SIZE, block_size=BLOCK_SIZE,
                **MODELS[preset])


def build_model(preset: str, device: Optional[str] = None) -> Any:
    """A GPT preset as a module (``device='meta'``: shapes only)."""
    import torch

    from mmfsdp.demo import GPT
    with torch.device(device or 'cpu'):
        return GPT(VOCAB_SIZE, BLOCK_SIZE, **MODELS[preset])


def parameter_count(preset: str) -> int:
    """P of a preset (the tied embedding counts once)."""
    return sum(p.numel() for p in build_model(preset, 'meta').parameters())


def runner_cfg(preset: str, wrapper_cfg: Dict[str, Any], work_dir: str, name: str,
               batch_size: int, seq_len: int, max_iters: int,
               train_cfg: Optional[Dict[str, Any]] = None) -> Any:
    """An FSDPRunner config: the demo GPT on the stdlib corpus, AdamW, no checkpoints.

    ``train_cfg`` (a loop with a ``type``) replaces the iteration-based loop.
    """
    from mmengine.config import Config
    train = dict(train_cfg) if train_cfg else dict(by_epoch=False, max_iters=max_iters)
    return Config(dict(
        model=model_cfg(preset),
        work_dir=work_dir, launcher='pytorch', log_level='WARNING',
        experiment_name=name.replace('/', '-'),
        runner_type='mmfsdp.FSDPRunner', model_wrapper_cfg=wrapper_cfg,
        randomness=dict(seed=0), env_cfg=dict(dist_cfg=dict(timeout=900)),
        train_dataloader=dict(
            dataset=dict(type='mmfsdp.StdlibCharDataset', block_size=seq_len,
                         max_chars=200_000),
            sampler=dict(type='DefaultSampler', shuffle=True),
            collate_fn=dict(type='default_collate'), batch_size=batch_size, num_workers=0),
        train_cfg=train,
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=LR)),
        default_hooks=dict(checkpoint=None, logger=dict(type='LoggerHook', interval=1000))))


def make_runner(cfg: Any) -> Any:
    """Build the runner of ``cfg`` with mmengine's own builder."""
    import mmfsdp
    return mmfsdp.FSDPRunner.from_cfg(cfg)


def warm_up(wrapper_cfg: Dict[str, Any], name: str) -> int:
    """Train the tiny GPT for one step under ``wrapper_cfg``; return the resident-set growth.

    Everything that does not depend on the model's size is paid here, before a
    baseline is taken: modules that mmengine and torch import lazily (the
    visualizer, FSDP, DTensor, the optimizer's helpers), the runner's scaffolding,
    gloo's buffers. Without it the first runner of a process adds some 70-90 MiB
    per rank to whatever it builds, whatever the model.
    """
    before = rss_bytes()
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir:
        runner = make_runner(runner_cfg('gpt-tiny', wrapper_cfg, work_dir, f'{name}-warm-up',
                                        1, 16, 1))
        runner.train()
        del runner
    gc.collect()
    return rss_bytes() - before


def plain_model(kind: str, preset: str, model: Any = None, seed: int = 0) -> tuple:
    """``(wrapped model, AdamW)`` written against torch's API with mmfsdp's default settings.

    ``kind``: ``'fsdp1'`` (FULL_SHARD, one unit per block, BACKWARD_PRE,
    limit_all_gathers, use_orig_params), ``'fsdp2'`` (``fully_shard`` per block
    then the root) or ``'ddp'`` (bucket views, no buffer broadcast). ``model``
    (default: ``preset`` initialised under ``seed``) is wrapped as given.
    """
    import torch
    import torch.distributed as dist

    from mmfsdp.demo import TransformerBlock
    if model is None:
        torch.manual_seed(seed)
        model = build_model(preset)
        model.init_weights()  # same seed on every rank: same weights, no broadcast needed
    if kind == 'fsdp1':
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD,
                     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                     backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                     device_id=torch.device('cpu'), limit_all_gathers=True,
                     use_orig_params=True)
    elif kind == 'fsdp2':
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh('cpu', (dist.get_world_size(), ))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == 'ddp':
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, gradient_as_bucket_view=True, broadcast_buffers=False)
    else:
        raise ValueError(f"kind: {kind!r} is not one of 'fsdp1', 'fsdp2', 'ddp'")
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def plain_step(model: Any, optimizer: Any, batch: Dict[str, Any]) -> float:
    """One hand-written training step; the loss."""
    loss = model(batch['inputs'], batch['data_samples'], mode='loss')['loss']
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def shared_tmpdir(prefix: str) -> str:
    """In a process group: a temporary directory made by rank 0, its name sent to every rank."""
    import torch.distributed as dist
    box = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads per rank: the cores shared evenly, at least one."""
    return max(1, (os.cpu_count() or 1) // world_size)
