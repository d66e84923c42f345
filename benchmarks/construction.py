"""Item 7: peak memory per rank while building and sharding a model, eager vs meta init.

One case builds the model through ``FSDPRunner`` with the FSDP2 wrapper
(``mmfsdp.MMFullyShard``) or the FSDP1 wrapper (FULL_SHARD), one unit per block,
eagerly (every rank builds, initialises and broadcasts the full model, then
shards it) or with ``init_device='meta'`` (FSDP2: every rank builds it on the
meta device, shards it, then allocates and initialises only its shards; FSDP1:
built on meta, materialised and initialised on the CPU, then moved to the
device unit by unit, so on a CPU-only machine the host, which is the device,
holds the full model). ``train()`` runs with zero
iterations, so everything up to the first step happens: model, wrapper,
optimizer (AdamW allocates its state lazily, at the first step). The peak is
the process's peak resident set up to ``before_train`` minus its resident set
before the model was built (after a warm-up step of the tiny GPT under the same
wrapper: see :func:`benchmarks.workload.warm_up`); the maximum over ranks is
reported.
"""
import math
import tempfile
from typing import Any, Dict, List

import torch.distributed as dist
from mmengine.hooks import Hook

from .measure import model_state_bytes, peak_rss_bytes, reset_peak_rss
from .workload import (
    BYTES_PER_ELEMENT,
    STRATEGIES,
    build_model,
    make_runner,
    runner_cfg,
    warm_up,
)

__all__ = ['bounds', 'run_case']


class _Probe(Hook):
    def before_train(self, runner: Any) -> None:
        self.peak = peak_rss_bytes()
        self.params = model_state_bytes(runner.model, None)['params']


#: The wrapper of each construction case, by ``case['wrapper']``.
WRAPPERS = {'fsdp2': 'FSDP2 reshard', 'fsdp1': 'FSDP1 FULL_SHARD'}


def bounds(preset: str, world_size: int, wrapper: str = 'fsdp2') -> Dict[str, int]:
    """The goal's terms: this rank's parameter shard and the largest unit, in bytes.

    FSDP2 pads every parameter along dim 0 to a multiple of the world size,
    FSDP1 each unit's flat parameter; a unit is a ``TransformerBlock`` or the
    root (everything else).
    """
    model = build_model(preset, 'meta')
    if wrapper == 'fsdp1':
        shard = (sum(math.ceil(sum(p.numel() for p in b.parameters()) / world_size)
                     for b in model.blocks)
                 + math.ceil(sum(p.numel() for p in model.parameters()
                                 if all(p is not q for b in model.blocks
                                        for q in b.parameters())) / world_size))
    else:
        shard = sum(math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0])
                    for p in model.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    params = sum(p.numel() for p in model.parameters())
    return dict(params=params, shard_bytes=shard * BYTES_PER_ELEMENT,
                largest_unit_bytes=max(block, root) * BYTES_PER_ELEMENT,
                full_model_bytes=params * BYTES_PER_ELEMENT,
                model_state_bytes=16 * params // world_size)


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """Build and shard one model (``case['init']``: ``'eager'`` or ``'meta'``;
    ``case['wrapper']``: ``'fsdp2'`` (default) or ``'fsdp1'``)."""
    wrapper = case.get('wrapper', 'fsdp2')
    wrapper_cfg = dict(STRATEGIES[WRAPPERS[wrapper]].wrapper_cfg)
    if case['init'] == 'meta':
        wrapper_cfg['init_device'] = 'meta'
    world = dist.get_world_size()
    warm_up_bytes = warm_up(wrapper_cfg, case['name'])
    baseline = reset_peak_rss()
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir:
        cfg = runner_cfg(case['model'], wrapper_cfg, work_dir, case['name'], 1, 16, 0)
        runner = make_runner(cfg)
        probe = _Probe()
        runner.register_hook(probe)
        runner.train()
        del runner
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, dict(peak=probe.peak - baseline, params=probe.params,
                                          warm_up=warm_up_bytes))
    if dist.get_rank() != 0:
        return {}
    terms = bounds(case['model'], world, wrapper)
    return dict(kind='construction', name=case['name'], model=case['model'],
                init=case['init'], wrapper=wrapper, world_size=world,
                peak_bytes=max(g['peak'] for g in gathered),
                peak_bytes_per_rank=[g['peak'] for g in gathered],
                param_storage_bytes=max(g['params'] for g in gathered),
                warm_up_bytes=max(g['warm_up'] for g in gathered),
                goal_bytes=terms['shard_bytes'] + 2 * terms['largest_unit_bytes'], **terms)
