"""Items 1-3: model-state bytes, peak memory and communication per rank per training step.

One case is one model, one strategy, one world size, trained through
``FSDPRunner`` with the mmfsdp wrapper. A hook measures every iteration:

- **model state**: the storages of the local parameters, gradients and AdamW
  state, counted right after ``optimizer.step()`` (an optimizer step hook),
  while the gradients still exist;
- **peak**: the process's peak resident set during the iteration (reset at its
  start) minus the resident set measured before the model was built (after a
  warm-up step of the tiny GPT under the same wrapper, which pays the costs that
  do not depend on the model: lazy imports, runner scaffolding, gloo buffers);
- **communication**: the ring send volume of every collective issued during
  the iteration (:mod:`benchmarks.comm`); DDP's buckets are routed through its
  default all-reduce hook so that they are counted too.

The first ``warmup`` iterations (AdamW allocates its state in the first) are
dropped; each figure is the maximum over ranks, summarised over iterations.
"""
import math
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from torch.nn.parallel import DistributedDataParallel

from .comm import CollectiveCounter, ddp_counting_hook
from .measure import model_state_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes, summary
from .workload import (
    BYTES_PER_ELEMENT,
    STRATEGIES,
    build_model,
    make_runner,
    runner_cfg,
    warm_up,
)

__all__ = ['plan_bytes', 'run_case']


class _StepProbe(Hook):
    """Measures each training iteration (see the module docstring)."""

    def __init__(self, counter: CollectiveCounter) -> None:
        self.counter = counter
        self.records: List[Dict[str, Any]] = []
        self._state: Dict[str, int] = {}

    def before_train(self, runner: Any) -> None:
        model = runner.model
        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, ddp_counting_hook)
        optimizer = runner.optim_wrapper.optimizer

        def after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            self._state = model_state_bytes(model, opt)

        optimizer.register_step_post_hook(after_step)

    def before_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None) -> None:
        self.counter.reset()
        reset_peak_rss()
        self._start = time.perf_counter()

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        elapsed = time.perf_counter() - self._start
        self.records.append(dict(
            time_s=elapsed, peak_bytes=peak_rss_bytes(), state=dict(self._state),
            comm=self.counter.snapshot(), loss=outputs['loss'].item()))


def plan_bytes(strategy: str, preset: str, world_size: int) -> Dict[str, Any]:
    """``mmfsdp.plan``'s prediction for this case (model on the meta device)."""
    from mmfsdp.plan import plan_for
    from mmfsdp.registry import MODEL_WRAPPERS
    cfg = dict(STRATEGIES[strategy].wrapper_cfg)
    wrapper_cls = MODEL_WRAPPERS.get(cfg['type'].split('.', 1)[-1])
    try:
        plan = plan_for(wrapper_cls, cfg, build_model(preset, 'meta'), world_size,
                        dict(type='AdamW'))
    except TypeError as e:  # the wrapper cannot describe its sharding
        return dict(available=False, reason=str(e))
    return dict(available=True, model_state_bytes=plan.model_state_bytes_per_rank,
                peak_estimate_bytes=plan.peak_bytes_per_rank_estimate,
                largest_unit_gathered_bytes=plan.largest_unit.gathered_bytes)


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """Train ``warmup + steps`` iterations of one case; return the result (rank 0)."""
    strategy = STRATEGIES[case['strategy']]
    wrapper_cfg = dict(strategy.wrapper_cfg, **case.get('wrapper_options', {}))
    world = dist.get_world_size()
    warm_up_bytes = warm_up(wrapper_cfg, case['name']) if case['warm_up'] else 0
    baseline = rss_bytes()  # before the model is built
    counter = CollectiveCounter()
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir, counter:
        cfg = runner_cfg(case['model'], wrapper_cfg, work_dir, case['name'],
                         case['batch_size'], case['seq_len'], case['warmup'] + case['steps'])
        runner = make_runner(cfg)
        probe = _StepProbe(counter)
        runner.register_hook(probe, priority='VERY_LOW')
        runner.train()
        del runner
    records = probe.records[case['warmup']:]
    gathered: List[Any] = [None] * world
    dist.all_gather_object(gathered, dict(baseline=baseline, records=records,
                                          warm_up=warm_up_bytes))
    if dist.get_rank() != 0:
        return {}
    params = sum(p.numel() for p in build_model(case['model'], 'meta').parameters())

    def per_step(fn: Any) -> List[float]:
        """For each measured step, the maximum over ranks of ``fn(rank, record)``."""
        return [max(fn(r, r_out['records'][i]) for r, r_out in enumerate(gathered))
                for i in range(len(records))]

    peak = per_step(lambda r, rec: rec['peak_bytes'] - gathered[r]['baseline'])
    state = per_step(lambda r, rec: rec['state']['total'])
    comm = per_step(lambda r, rec: rec['comm']['send_bytes'])
    pb = params * BYTES_PER_ELEMENT
    return dict(
        kind='memory', name=case['name'], model=case['model'], params=params,
        strategy=case['strategy'], world_size=world, batch_size=case['batch_size'],
        seq_len=case['seq_len'], warmup=case['warmup'], steps=len(records),
        model_state_bytes=summary(state),
        model_state_parts=[out['records'][-1]['state'] for out in gathered],
        peak_bytes=summary(peak),
        baseline_bytes=[out['baseline'] for out in gathered],
        warm_up_bytes=[out['warm_up'] for out in gathered],
        comm_send_bytes=summary(comm),
        comm_by_op=records[-1]['comm']['by_op'],
        step_time_s=summary(rec['time_s'] for rec in records),
        loss_finite=all(math.isfinite(rec['loss']) for rec in records),
        theory=dict(model_state_bytes=strategy.state_bytes_per_param(world) * params,
                    model_state_formula=strategy.state_bound,
                    comm_bytes=strategy.comm_factor(world) * pb,
                    comm_formula=strategy.comm_formula),
        plan=plan_bytes(case['strategy'], case['model'], world))
