"""Wrapper overhead: ``FSDPRunner`` + mmfsdp against hand-written torch loops, interleaved.

``python -m benchmarks.overhead``: per wrapper one torchrun job trains the same
model, batch and wrap policy two (FSDP2: three) ways in one process group:

- ``mmfsdp``: an iteration of ``FSDPRunner``'s own train loop (hooks, data
  preprocessor, the wrapper's ``train_step``, ``OptimWrapper.update_params``);
- ``torch-<kind>``: a hand-written step (forward, ``backward()``, ``AdamW.step()``,
  ``zero_grad()``) on a second copy of the model wrapped with torch's API and the same
  settings; the FSDP2 job also runs hand-written FSDP1, for the FSDP2 / FSDP1 ratio.

After ``--warmup`` steps of each arm, ``--steps`` rounds run one step of each,
the order alternating every round, each step timed between two barriers. The
ratio of a round is ``mmfsdp / torch``. Blocks: ``overhead``, ``fsdp2-vs-fsdp1-time``.
"""
import argparse
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

from .core import records
from .core.launch import torchrun
from .core.measure import summary
from .core.records import spread
from .core.workload import STRATEGIES, make_runner, plain_model, plain_step, runner_cfg

#: The mmfsdp strategy of each hand-written kind.
WRAPPERS = {'fsdp1': 'FSDP1 FULL_SHARD', 'fsdp2': 'FSDP2 reshard', 'ddp': 'DDP'}
GOAL = 1.03


def interleaved_loop() -> type:
    """Register and return the train loop that interleaves the runner with plain steps."""
    import torch.distributed as dist
    from mmengine.registry import LOOPS
    from mmengine.runner import IterBasedTrainLoop

    def timed(step: Callable[[], Any]) -> float:
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        return time.perf_counter() - start

    @LOOPS.register_module(name='BenchmarkInterleavedLoop', force=True)
    class InterleavedLoop(IterBasedTrainLoop):
        """Warm up every arm on one batch, then time ``steps`` alternating rounds."""

        def __init__(self, runner: Any, dataloader: Any, preset: str, plain: List[str],
                     warmup: int, steps: int, **kwargs: Any) -> None:
            super().__init__(runner, dataloader, max_iters=warmup + steps, **kwargs)
            self.preset, self.plain, self.warmup, self.steps = preset, plain, warmup, steps
            self.times: Dict[str, List[float]] = {}

        def run(self) -> Any:
            self.runner.call_hook('before_train')
            self.runner.call_hook('before_train_epoch')
            batch = next(self.dataloader_iterator)
            self.runner.model.train()
            arms: Dict[str, Callable[[], Any]] = {'mmfsdp': lambda: self.run_iter(batch)}
            for kind in self.plain:
                model, optimizer = plain_model(kind, self.preset)
                arms[f'torch-{kind}'] = (lambda m=model, o=optimizer: plain_step(m, o, batch))
            names = list(arms)
            for _ in range(self.warmup):
                for name in names:
                    arms[name]()
            self.times = {name: [] for name in names}
            for i in range(self.steps):
                for name in (names if i % 2 == 0 else names[::-1]):
                    self.times[name].append(timed(arms[name]))
            self.runner.call_hook('after_train_epoch')
            self.runner.call_hook('after_train')
            return self.runner.model

    return InterleavedLoop


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: time one wrapper against its hand-written loop(s)."""
    import torch.distributed as dist
    interleaved_loop()
    kind = case['wrapper']
    plain = [kind] + (['fsdp1'] if kind == 'fsdp2' else [])
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir:
        loop = dict(type='BenchmarkInterleavedLoop', preset=case['model'], plain=plain,
                    warmup=case['warmup'], steps=case['steps'])
        runner = make_runner(runner_cfg(case['model'], STRATEGIES[WRAPPERS[kind]].wrapper_cfg,
                                        work_dir, case['name'], case['batch_size'],
                                        case['seq_len'], 0, train_cfg=loop))
        runner.train()
        times = runner.train_loop.times
        del runner
    if dist.get_rank():
        return {}
    return dict(case, times=times, world_size=dist.get_world_size())


def tables(results: List[Dict[str, Any]]) -> Dict[str, str]:
    """The overhead table and the FSDP2 / FSDP1 line."""
    rows, line = [], 'No FSDP2 job was run.'
    for r in results:
        mine, torch_ = r['times']['mmfsdp'], r['times'][f"torch-{r['wrapper']}"]
        ratio = summary(a / b for a, b in zip(mine, torch_))
        rows.append([WRAPPERS[r['wrapper']], spread(summary(mine), '{:.3f}'),
                     spread(summary(torch_), '{:.3f}'), spread(ratio, '{:.3f}'),
                     spread(summary((a - b) * 1000 for a, b in zip(mine, torch_)), '{:+.0f}'),
                     '**pass**' if ratio['median'] <= GOAL else '**fail**'])
        if r['wrapper'] == 'fsdp2':
            two, one = r['times']['torch-fsdp2'], r['times']['torch-fsdp1']
            line = (f"Step time, interleaved in one process group ({r['model']}, "
                    f"N = {r['world_size']}, hand-written torch loops of both, {r['steps']} "
                    f"rounds): FSDP2 / FSDP1 = "
                    f"**{spread(summary(a / b for a, b in zip(two, one)), '{:.3f}')}** "
                    f"(FSDP2 {spread(summary(two), '{:.3f}')} s, FSDP1 "
                    f"{spread(summary(one), '{:.3f}')} s per step).")
    columns = ['wrapper', 'mmfsdp step s', 'hand-written torch step s', 'ratio median (min–max)',
               'mmfsdp − torch, ms per step', f'≤ {GOAL}']
    return {'overhead': records.header('python -m benchmarks.overhead') + '\n\n'
            + records.table(columns, rows), 'fsdp2-vs-fsdp1-time': line}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.overhead',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-25m')
    parser.add_argument('--world-size', type=int, default=2)
    parser.add_argument('--wrappers', nargs='+', default=list(WRAPPERS), choices=list(WRAPPERS))
    parser.add_argument('--batch-size', type=int, default=2)
    parser.add_argument('--seq-len', type=int, default=64)
    parser.add_argument('--warmup', type=int, default=2, help='untimed steps of every arm')
    parser.add_argument('--steps', type=int, default=20, help='timed rounds')
    records.add_output_options(parser, 'overhead')
    args = parser.parse_args(argv)
    results = []
    for kind in args.wrappers:
        case = dict(model=args.model, wrapper=kind, batch_size=args.batch_size,
                    seq_len=args.seq_len, warmup=args.warmup, steps=args.steps,
                    name=f'overhead/{args.model}/N{args.world_size}/{kind}')
        results += torchrun('overhead', [case], args.world_size, memory=False)
        records.save_results(args.out, results)
    records.finish(args, tables(results))


if __name__ == '__main__':
    main()
