"""Items 4-5: step time through FSDPRunner + mmfsdp wrapper vs hand-written torch loops.

One case trains the same model, batch and wrap policy in one process group
two (or three) ways, interleaved:

- ``mmfsdp``: an iteration of ``FSDPRunner``'s own train loop
  (``IterBasedTrainLoop.run_iter``: the hooks, the data preprocessor, the
  wrapper's ``train_step``, ``OptimWrapper.update_params``);
- ``torch-<kind>``: a hand-written step (forward, ``backward()``,
  ``AdamW.step()``, ``zero_grad()``) on a second copy of the model wrapped
  with torch's API and the same settings (:func:`benchmarks.workload.plain_model`).

After ``warmup`` steps of each, ``steps`` rounds run one step of each arm,
alternating the order every round; each step is timed between two barriers
on rank 0. The overhead ratio of a round is ``mmfsdp / torch-<kind>``; with a
third arm (FSDP2 cases also run hand-written FSDP1) the FSDP2 / FSDP1 ratio
comes from the same rounds.
"""
import tempfile
import time
from typing import Any, Callable, Dict, List, Sequence

import torch.distributed as dist
from mmengine.registry import LOOPS
from mmengine.runner import IterBasedTrainLoop

from .measure import summary
from .workload import STRATEGIES, make_runner, plain_model, plain_step, runner_cfg

__all__ = ['InterleavedLoop', 'run_case']

#: mmfsdp wrapper of each hand-written kind.
WRAPPER = {'ddp': 'DDP', 'fsdp1': 'FSDP1 FULL_SHARD', 'fsdp2': 'FSDP2 reshard'}


def _timed(step: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


@LOOPS.register_module(name='BenchmarkInterleavedLoop')
class InterleavedLoop(IterBasedTrainLoop):
    """A train loop that interleaves the runner's iterations with hand-written steps.

    Args:
        runner, dataloader: As for ``IterBasedTrainLoop``.
        preset: The GPT preset of the hand-written copies.
        plain: Kinds of hand-written arms (``'fsdp1'``, ``'fsdp2'``, ``'ddp'``).
        warmup: Untimed steps of every arm.
        steps: Timed rounds.
    """

    def __init__(self, runner: Any, dataloader: Any, preset: str, plain: Sequence[str],
                 warmup: int, steps: int, **kwargs: Any) -> None:
        super().__init__(runner, dataloader, max_iters=warmup + steps, **kwargs)
        self.preset, self.plain = preset, list(plain)
        self.warmup, self.steps = warmup, steps
        self.times: Dict[str, List[float]] = {}

    def run(self) -> Any:
        """Warm up every arm, then time ``steps`` interleaved rounds."""
        self.runner.call_hook('before_train')
        self.runner.call_hook('before_train_epoch')
        batch = next(self.dataloader_iterator)
        self.runner.model.train()
        arms: Dict[str, Callable[[], Any]] = {'mmfsdp': lambda: self.run_iter(batch)}
        for kind in self.plain:
            model, optimizer = plain_model(kind, self.preset)
            arms[f'torch-{kind}'] = (
                lambda model=model, optimizer=optimizer: plain_step(model, optimizer, batch))
        names = list(arms)
        for _ in range(self.warmup):
            for name in names:
                arms[name]()
        self.times = {name: [] for name in names}
        for i in range(self.steps):
            for name in (names if i % 2 == 0 else names[::-1]):
                self.times[name].append(_timed(arms[name]))
        self.runner.call_hook('after_train_epoch')
        self.runner.call_hook('after_train')
        return self.runner.model


def _ratios(numerator: List[float], denominator: List[float]) -> Dict[str, float]:
    return summary(a / b for a, b in zip(numerator, denominator))


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """Time one wrapper against its hand-written loop(s); return the result (rank 0)."""
    kind = case['wrapper']
    plain = [kind] + list(case.get('also', []))
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir:
        cfg = runner_cfg(case['model'], STRATEGIES[WRAPPER[kind]].wrapper_cfg, work_dir,
                         case['name'], case['batch_size'], case['seq_len'], 0,
                         train_cfg=dict(type='BenchmarkInterleavedLoop', preset=case['model'],
                                        plain=plain, warmup=case['warmup'],
                                        steps=case['steps']))
        runner = make_runner(cfg)
        runner.train()
        times = runner.train_loop.times
        del runner
    if dist.get_rank() != 0:
        return {}
    result = dict(kind='overhead', name=case['name'], model=case['model'], wrapper=kind,
                  strategy=WRAPPER[kind], world_size=dist.get_world_size(),
                  batch_size=case['batch_size'], seq_len=case['seq_len'],
                  warmup=case['warmup'], steps=case['steps'],
                  step_time_s={name: summary(t) for name, t in times.items()},
                  ratio=_ratios(times['mmfsdp'], times[f'torch-{kind}']),
                  extra_s=summary(a - b for a, b in zip(times['mmfsdp'],
                                                        times[f'torch-{kind}'])))
    if 'torch-fsdp1' in times and kind == 'fsdp2':
        result['fsdp2_over_fsdp1'] = _ratios(times['torch-fsdp2'], times['torch-fsdp1'])
    return result
