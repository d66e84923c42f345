"""The peers side by side: ``python -m benchmarks.peers``.

The same GPT, per-rank batches and initial weights (one file, loaded through each
framework's ``init_weights`` path or before wrapping) trained by every arm:
hand-written torch FSDP1 / FSDP2 / DDP, mmfsdp through ``FSDPRunner``,
accelerate's FSDP1 and FSDP2 plugins, Lightning Fabric's ``FSDPStrategy`` and
``ModelParallelStrategy``, and mmengine's ``FlexibleRunner`` with its own
``FSDPStrategy`` (accelerate and Lightning: ``pip install -e .[benchmarks]``).
Two kinds of torchrun job (N CPU processes, gloo):

- **memory**, one job per arm and repeat (``--memory-repeats``, every arm once
  before any twice): a warm-up step of the tiny GPT under the arm, the resident-set
  baseline, then the arm built and trained ``--memory-steps`` steps; per step the
  peak resident set above the baseline and the model-state bytes (right after
  ``optimizer.step()``). The parameter bytes per rank tell whether the arm really
  shards. A failing arm is recorded with its exact error and not run again.
- **interleaved**, one job holding every arm that ran: ``--steps`` rounds of one
  step of every arm on the round's batch, the order rotated every round, each step
  timed between two barriers; a round's ratio is the arm's time over the hand-written
  torch arm of its family (the first ``--timed-from`` rounds left out), and the loss
  of every step is kept to check that all arms train the same thing.

Block: ``peers`` (the table, the failures, mmfsdp's goals against its peers).
"""
import argparse
import gc
import itertools
import os
import shutil
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from .core import records
from .core.launch import REPO, JobFailed, error_line, load_average, torchrun
from .core.measure import model_state_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes, summary
from .core.records import mib
from .core.workload import (
    BLOCK_SIZE,
    LR,
    MODELS,
    STRATEGIES,
    VOCAB_SIZE,
    make_runner,
    parameter_count,
    plain_model,
    plain_step,
    runner_cfg,
    shared_tmpdir,
)

#: Arm -> family (the hand-written torch arm it is timed against: FAMILIES).
ARMS = {'torch FSDP1': 'fsdp1', 'torch FSDP2': 'fsdp2', 'torch DDP': 'ddp',
        'mmfsdp FSDP1': 'fsdp1', 'mmfsdp FSDP2': 'fsdp2', 'mmfsdp DDP': 'ddp',
        'accelerate FSDP1': 'fsdp1', 'accelerate FSDP2': 'fsdp2',
        'Fabric FSDPStrategy': 'fsdp1', 'Fabric ModelParallelStrategy': 'fsdp2',
        'mmengine FlexibleRunner FSDP': 'fsdp1',
        'mmengine FlexibleRunner FSDP, device_id=cpu': 'fsdp1'}
FAMILIES = {'fsdp1': 'torch FSDP1', 'fsdp2': 'torch FSDP2', 'ddp': 'torch DDP'}
MMFSDP = {'fsdp1': 'mmfsdp FSDP1', 'fsdp2': 'mmfsdp FSDP2', 'ddp': 'mmfsdp DDP'}
#: Every arm seeds with this, the way its framework documents; the weights come from a file.
SEED = 0
RATIO_GOAL = 1.03
LOSS_TOLERANCE = 1e-4
#: An arm shards when its parameters per rank are below this fraction of the full model.
SHARDED_BELOW = 0.75
#: mmengine names a runner's logger ``experiment_name + timestamp`` and reuses an instance of
#: that name: runners built within a second would share one; every build gets its own name.
_BUILDS = itertools.count()


class Trainer:
    """A built arm: ``step(batch)`` trains one step and returns this rank's loss."""

    def __init__(self, step: Callable[[Dict[str, Any]], float], module: Any, optimizer: Any,
                 close: Callable[[], None] = lambda: None, notes: str = '') -> None:
        self.step, self.module, self.optimizer = step, module, optimizer
        self.close, self.notes = close, notes


def _peer_model(preset: str, init_file: str) -> Any:
    """The demo GPT whose ``init_weights`` loads the shared initial weights (registered once)."""
    import torch

    from mmfsdp.demo import GPT
    from mmfsdp.registry import MODELS as MMFSDP_MODELS

    class PeerGPT(GPT):
        def __init__(self, init_file: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.init_file = init_file

        def init_weights(self) -> None:
            self.load_state_dict(torch.load(self.init_file, weights_only=True))

    if 'BenchmarkPeerGPT' not in MMFSDP_MODELS.module_dict:
        MMFSDP_MODELS.register_module('BenchmarkPeerGPT', module=PeerGPT)
    return dict(type='mmfsdp.BenchmarkPeerGPT', init_file=init_file, vocab_size=VOCAB_SIZE,
                block_size=BLOCK_SIZE, **MODELS[preset])


def _model(preset: str, init_file: str) -> Any:
    from mmfsdp.registry import MODELS as MMFSDP_MODELS
    model = MMFSDP_MODELS.build(_peer_model(preset, init_file))
    model.init_weights()
    return model


def _loop_step(model: Any, optimizer: Any, backward: Callable[[Any], None]) -> Callable:
    def step(batch: Dict[str, Any]) -> float:
        loss = model(batch['inputs'], batch['data_samples'], mode='loss')['loss']
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _runner_trainer(runner: Any) -> Trainer:
    """Start a runner's training without iterating; the caller steps it."""
    from mmengine.hooks import Hook
    from mmengine.registry import LOOPS
    from mmengine.runner import IterBasedTrainLoop

    @LOOPS.register_module(name='BenchmarkPeersLoop', force=True)
    class PeersLoop(IterBasedTrainLoop):  # noqa: F841 - registered, built by the runner
        def __init__(self, runner: Any, dataloader: Any, **kwargs: Any) -> None:
            super().__init__(runner, dataloader, max_iters=10**6, **kwargs)

        def run(self) -> Any:
            self.runner.call_hook('before_train')
            self.runner.call_hook('before_train_epoch')
            self.runner.model.train()
            return self.runner.model

    class LossProbe(Hook):
        loss = float('nan')

        def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                             outputs: Any = None) -> None:
            self.loss = outputs['loss'].item()

    runner = runner() if callable(runner) else runner
    probe = LossProbe()
    runner.register_hook(probe, priority='VERY_LOW')
    runner.train()

    def step(batch: Dict[str, Any]) -> float:
        runner.train_loop.run_iter(batch)
        return probe.loss

    return Trainer(step, runner.model, runner.optim_wrapper.optimizer)


#: The runner arms' dataloader: built (their loops need one), never iterated; batches
#: come from the caller, so the dataset holds 1 KiB of text.
DATALOADER = dict(dataset=dict(type='mmfsdp.StdlibCharDataset', block_size=16, max_chars=1024),
                  sampler=dict(type='DefaultSampler', shuffle=False),
                  collate_fn=dict(type='default_collate'), batch_size=1, num_workers=0)


def build(label: str, preset: str, init_file: str, work_dir: str) -> Trainer:
    """Build the arm ``label``."""
    import torch
    import torch.distributed as dist
    name = f"peers-{label.replace(' ', '-').replace(',', '')}-{next(_BUILDS)}"
    if label.startswith('torch'):
        torch.manual_seed(SEED)
        model, optimizer = plain_model(ARMS[label], preset, model=_model(preset, init_file))
        return Trainer(lambda batch: plain_step(model, optimizer, batch), model, optimizer)
    if label.startswith('mmfsdp'):
        strategy = {'fsdp1': 'FSDP1 FULL_SHARD', 'fsdp2': 'FSDP2 reshard', 'ddp': 'DDP'}
        cfg = runner_cfg(preset, STRATEGIES[strategy[ARMS[label]]].wrapper_cfg, work_dir, name,
                         1, 16, 0, train_cfg=dict(type='BenchmarkPeersLoop'))
        cfg.model, cfg.train_dataloader = _peer_model(preset, init_file), DATALOADER
        cfg.randomness = dict(seed=SEED)
        return _runner_trainer(lambda: make_runner(cfg))
    if label.startswith('mmengine'):
        from mmengine.runner import FlexibleRunner
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from mmfsdp.demo import TransformerBlock
        wrapper = dict(type='MMFullyShardedDataParallel', sharding_strategy='FULL_SHARD',
                       auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                       backward_prefetch='BACKWARD_PRE', limit_all_gathers=True,
                       use_orig_params=True)
        if label.endswith('device_id=cpu'):  # FSDPStrategy's default: int(LOCAL_RANK)
            wrapper['device_id'] = torch.device('cpu')
        return _runner_trainer(lambda: FlexibleRunner(
            model=_peer_model(preset, init_file), work_dir=work_dir,
            strategy=dict(type='FSDPStrategy', model_wrapper=wrapper),
            optim_wrapper=dict(type='OptimWrapper', optimizer=dict(type='AdamW', lr=LR)),
            train_dataloader=DATALOADER, train_cfg=dict(type='BenchmarkPeersLoop'),
            default_hooks=dict(checkpoint=None, logger=dict(type='LoggerHook', interval=10**6)),
            launcher='pytorch', env_cfg=dict(dist_cfg=dict(backend='gloo')),
            log_level='WARNING', randomness=dict(seed=SEED), experiment_name=name))
    if label.startswith('accelerate'):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import FullyShardedDataParallelPlugin, set_seed
        version = 2 if ARMS[label] == 'fsdp2' else 1
        AcceleratorState._reset_state()  # one state per process; a second arm replaces it
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=version, auto_wrap_policy='transformer_based_wrap',
            transformer_cls_names_to_wrap=['TransformerBlock'],
            reshard_after_forward=True if version == 2 else 'FULL_SHARD',
            backward_prefetch='BACKWARD_PRE' if version == 1 else None,
            limit_all_gathers=True, use_orig_params=True, sync_module_states=False,
            state_dict_type='SHARDED_STATE_DICT')
        # cpu=True: accelerate's documented CPU switch; without it, on a machine without an
        # accelerator, it picks DistributedType.NO under torchrun: no wrapper at all.
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        set_seed(SEED)
        model = _model(preset, init_file)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
        state = accelerator.state
        kept = getattr(state, 'fsdp_plugin', None) is not None
        return Trainer(_loop_step(model, optimizer, accelerator.backward), model,
                       optimizer.optimizer, accelerator.free_memory,
                       notes=f'distributed_type={state.distributed_type.value}, '
                       f"fsdp_plugin {'kept' if kept else 'dropped'}")
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy
    from torch.distributed.fsdp import BackwardPrefetch, fully_shard

    from mmfsdp.demo import TransformerBlock
    world = dist.get_world_size()
    if label == 'Fabric FSDPStrategy':
        strategy: Any = FSDPStrategy(
            auto_wrap_policy={TransformerBlock}, sharding_strategy='FULL_SHARD',
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE, limit_all_gathers=True,
            use_orig_params=True)
    else:
        def parallelize(model: Any, device_mesh: Any) -> Any:
            for block in model.blocks:
                fully_shard(block, mesh=device_mesh['data_parallel'])
            fully_shard(model, mesh=device_mesh['data_parallel'])
            return model
        strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=world,
                                         tensor_parallel_size=1)
    fabric = Fabric(accelerator='cpu', devices=world, num_nodes=1, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(SEED)
    model = fabric.setup_module(_model(preset, init_file))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    return Trainer(_loop_step(model, optimizer, fabric.backward), model, optimizer.optimizer)


def wrapper_name(module: Any) -> str:
    """The class that wraps the model (under Fabric's own module wrapper)."""
    return type(getattr(module, '_forward_module', module)).__name__


# ----------------------------------------------------------------- in the torchrun job

def _batches(seq_len: int, batch_size: int, steps: int) -> List[Dict[str, Any]]:
    """This rank's batches: windows of the stdlib corpus drawn with a per-rank seed."""
    import torch
    import torch.distributed as dist
    from mmengine.dataset import default_collate

    from mmfsdp.demo import StdlibCharDataset
    dataset = StdlibCharDataset(block_size=seq_len, max_chars=200_000)
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    return [default_collate([dataset[int(i)] for i in
                             torch.randint(len(dataset), (batch_size, ), generator=generator)])
            for _ in range(steps)]


def _init_file(work_dir: str, preset: str) -> str:
    """The shared initial weights of ``preset`` (the GPT's own init under the seed)."""
    import torch
    import torch.distributed as dist

    from mmfsdp.demo import GPT
    path = os.path.join(work_dir, f'init-{preset}.pt')
    if dist.get_rank() == 0:
        torch.manual_seed(SEED)
        model = GPT(VOCAB_SIZE, BLOCK_SIZE, **MODELS[preset])
        model.init_weights()
        torch.save(model.state_dict(), path)
    dist.barrier()
    return path


def _state_probe(trainer: Trainer, states: List[Dict[str, int]]) -> Any:
    return trainer.optimizer.register_step_post_hook(
        lambda opt, args, kwargs: states.append(model_state_bytes(trainer.module, opt)))


def _memory(case: Dict[str, Any], work_dir: str) -> Dict[str, Any]:
    """Warm up, take the baseline, build the arm and train it; an error is the result."""
    import torch.distributed as dist
    label, stage, trainer = case['arms'][0], 'build', None
    try:
        tiny = build(label, 'gpt-tiny', _init_file(work_dir, 'gpt-tiny'),
                     os.path.join(work_dir, 'warm-up'))
        tiny.step(_batches(case['seq_len'], 1, 1)[0])
        tiny.close()
        del tiny
        gc.collect()
        batches = _batches(case['seq_len'], case['batch_size'], case['steps'])
        init = _init_file(work_dir, case['model'])
        baseline = rss_bytes()
        trainer = build(label, case['model'], init, os.path.join(work_dir, 'arm'))
        states: List[Dict[str, int]] = []
        _state_probe(trainer, states)
        stage, peaks, losses = 'train', [], []
        for batch in batches:
            dist.barrier()
            reset_peak_rss()
            losses.append(trainer.step(batch))
            peaks.append(peak_rss_bytes() - baseline)
        return dict(ok=True, peaks=peaks, losses=losses, states=states,
                    wrapper=wrapper_name(trainer.module), notes=trainer.notes)
    except Exception as e:  # noqa: BLE001 - the error is the result
        print(f'[rank{dist.get_rank()}] {stage} failed:\n' + traceback.format_exc(),
              file=sys.stderr, flush=True)
        where = [f"{f.filename.split('site-packages/')[-1].replace(REPO + os.sep, '')}:"
                 f'{f.lineno} {f.name}' for f in traceback.extract_tb(e.__traceback__)[-1:]]
        return dict(ok=False, stage=stage, where=where,
                    error=''.join(traceback.format_exception_only(type(e), e)).strip()[:1500])
    finally:
        if trainer is not None:
            trainer.close()


def _interleaved(case: Dict[str, Any], work_dir: str) -> Dict[str, Any]:
    """Every arm built, then trained round by round; an error ends the job (it may be one
    rank's alone, and the ranks must not go on into different collectives)."""
    import torch.distributed as dist
    batches = _batches(case['seq_len'], case['batch_size'], case['steps'])
    init = _init_file(work_dir, case['model'])
    trainers = {label: build(label, case['model'], init,
                             os.path.join(work_dir, label.replace(' ', '-')))
                for label in case['arms']}
    times: Dict[str, List[float]] = {label: [] for label in trainers}
    losses: Dict[str, List[float]] = {label: [] for label in trainers}
    order = list(trainers)
    for i, batch in enumerate(batches):
        k = i % len(order)
        for label in order[k:] + order[:k]:
            dist.barrier()
            start = time.perf_counter()
            losses[label].append(trainers[label].step(batch))
            dist.barrier()
            times[label].append(time.perf_counter() - start)
    return dict(times=times, losses=losses,
                wrappers={label: wrapper_name(t.module) for label, t in trainers.items()},
                notes={label: t.notes for label, t in trainers.items()})


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    """In a torchrun job: one memory or interleaved case; rank 0 returns every rank's."""
    import torch.distributed as dist
    work_dir = shared_tmpdir('mmfsdp-peers-')
    try:
        measure = _memory if case['mode'] == 'memory' else _interleaved
        ranks: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, measure(case, work_dir))
        dist.barrier()
    finally:
        if dist.get_rank() == 0:
            shutil.rmtree(work_dir, ignore_errors=True)
    if dist.get_rank():
        return {}
    return dict(case, ranks=ranks, params=parameter_count(case['model']))


# ----------------------------------------------------------------- the orchestrator

def _job(case: Dict[str, Any], nproc: int, memory: bool, timeout: float) -> Dict[str, Any]:
    load = load_average()
    try:
        result = torchrun('peers', [case], nproc, timeout, memory=memory)[0]
    except JobFailed as e:
        result = dict(case, job_failed=error_line(e), load_before=load,
                      load_after=load_average())
    print(f"{case['name']} (N={nproc}): load {result['load_before']} -> {result['load_after']}"
          + (f" FAILED: {result['job_failed']}" if 'job_failed' in result else ''),
          file=sys.stderr, flush=True)
    return result


def _memory_summary(jobs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """An arm's memory jobs pooled: the steps after each job's first, worst rank per step."""
    for job in jobs:
        if 'job_failed' in job:
            return dict(ok=False, stage='job', error=job['job_failed'], where=[])
        failed = [r for r in job['ranks'] if not r['ok']]
        if failed:
            return failed[0]
    peak, state = [], []
    for job in jobs:
        ranks = job['ranks']
        for i in range(1, len(ranks[0]['peaks'])):  # AdamW allocates its state in step 1
            peak.append(max(r['peaks'][i] for r in ranks))
            state.append(max(r['states'][i]['total'] for r in ranks))
    last = jobs[-1]['ranks']
    return dict(ok=True, peak=summary(peak), state=summary(state), wrapper=last[0]['wrapper'],
                notes=last[0]['notes'], params=max(r['states'][-1]['params'] for r in last))


def arm_rows(results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One record per arm: its memory (if measured), ratio to its torch arm, last loss."""
    jobs: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        if r['mode'] == 'memory':
            jobs.setdefault(r['arms'][0], []).append(r)
    inter = next((r for r in results if r['mode'] == 'interleaved' and 'ranks' in r), None)
    times = inter['ranks'][0]['times'] if inter else {}
    losses = {label: [rank['losses'][label][-1] for rank in inter['ranks']]
              for label in times} if inter else {}
    reference_loss = losses.get('torch DDP') or next(iter(losses.values()), None)
    rows = []
    for label in [a for a in ARMS if a in jobs or a in times]:
        row: Dict[str, Any] = dict(label=label, family=ARMS[label],
                                   memory=_memory_summary(jobs[label]) if label in jobs else None)
        if inter and label in times:
            row['wrapper'] = inter['ranks'][0]['wrappers'][label]
            row['notes'] = inter['ranks'][0]['notes'][label]
            ref, skip = FAMILIES[ARMS[label]], inter['timed_from']
            if ref in times and times[label][skip:]:
                row['ratio'] = summary(a / b for a, b in zip(times[label][skip:],
                                                             times[ref][skip:]))
            row['loss'] = losses[label]
            row['loss_delta'] = max(abs(a - b) for a, b in zip(losses[label], reference_loss))
        mem = row['memory']
        if mem and mem['ok']:
            row.update(wrapper=mem['wrapper'], notes=mem['notes'])
            row['sharded'] = mem['params'] < SHARDED_BELOW * 4 * results[0]['params']
        rows.append(row)
    return rows


def _cells(row: Dict[str, Any], full: int) -> List[str]:
    mem, label = row['memory'], row['label']
    if mem is not None and not mem['ok']:
        stage = 'fails while building' if mem['stage'] == 'build' else f"fails: {mem['stage']}"
        return [label, row['family'].upper(), f'**no**: {stage} (see below)'] + ['—'] * 6
    if mem is None:
        memory = ['— (not measured)'] * 3
    else:
        shard = ('yes' if row['sharded'] else 'no (replicated, as configured)'
                 if row['family'] == 'ddp' else '**no: does not shard**')
        memory = [f"{mib(mem['params'])} of {mib(full)} — {shard}", mib(mem['state']['max']),
                  records.spread(mem['peak'], '{:,.1f}', 1 / records.MIB)]
    ratio, delta = row.get('ratio'), row.get('loss_delta')
    agree = '' if delta is None else (f' (Δ {delta:.1e})' if delta <= LOSS_TOLERANCE
                                      else f' (**Δ {delta:.1e}**)')
    return [label, row['family'].upper(), 'yes',
            row.get('wrapper', '—') + (f"; {row['notes']}" if row.get('notes') else ''),
            *memory,
            '1 (reference)' if label == FAMILIES[row['family']] else
            records.spread(ratio, '{:.3f}') if ratio else '—',
            f"{row['loss'][0]:.6f}{agree}" if row.get('loss') else '—']


def goals(rows: List[Dict[str, Any]]) -> List[List[str]]:
    """mmfsdp against every arm of its family that runs at the same settings: it trains,
    shards where the family shards, and its loss agrees."""
    by = {r['label']: r for r in rows}
    out = []
    for fam, mine in MMFSDP.items():
        me = by.get(mine)
        if not me:
            continue
        peers = [r for r in rows if r['family'] == fam and r['label'] != mine and r['memory']
                 and r['memory']['ok'] and (fam == 'ddp' or r['sharded'])
                 and r.get('loss_delta', 0) <= LOSS_TOLERANCE]
        for key, name, stat in (('state', 'model state', 'max'), ('peak', 'peak', 'median')):
            if not (me['memory'] and me['memory']['ok'] and peers):
                continue
            value = me['memory'][key][stat]
            worst = max(peers, key=lambda r: value / r['memory'][key][stat])
            ratio = value / worst['memory'][key][stat]
            out.append([f'{mine}: {name} per rank ≤ every {fam.upper()} peer that runs',
                        '≤ 1.00 × the lowest peer', f"{ratio:.3f} × {worst['label']} "
                        f"({mib(value)} / {mib(worst['memory'][key][stat])} MiB)",
                        '**pass**' if ratio <= 1 else '**fail**'])
        if me.get('ratio'):
            r = me['ratio']
            out.append([f'{mine}: step time / {FAMILIES[fam]}, same rounds', f'≤ {RATIO_GOAL}',
                        f"{records.spread(r, '{:.3f}')} over {r['n']} rounds",
                        '**pass**' if r['median'] <= RATIO_GOAL else '**fail**'])
    return out


def report(results: List[Dict[str, Any]]) -> str:
    """The block: the arms' table, the arms that fail with their errors, the goals."""
    rows = arm_rows(results)
    full = 4 * results[0]['params']
    text = records.table(
        ['arm', 'family', 'runs on CPU', 'wrapper found (framework notes)',
         'parameters per rank MiB — shards?', 'model state MiB per rank',
         'peak MiB per rank, median (min–max)', 'step time / torch arm, median (min–max)',
         'loss after the last step (rank 0)'], [_cells(r, full) for r in rows])
    failed = [r for r in rows if r['memory'] is not None and not r['memory']['ok']]
    if failed:
        text += '\n\nArms that do not run on CPU, with the exact error (rank 0):\n\n' + '\n'.join(
            f"- **{r['label']}** ({r['memory']['stage']}): `{r['memory']['error']}`"
            + (f" — raised at `{r['memory']['where'][-1]}`" if r['memory']['where'] else '')
            for r in failed)
    inter = [r for r in results if r['mode'] == 'interleaved']
    if inter and 'job_failed' in inter[0]:
        text += f"\n\nThe interleaved job failed: `{inter[0]['job_failed']}`"
    found = goals(rows)
    if found:
        text += '\n\n' + records.table(['goal', 'target', 'measured', 'result'], found)
    return text


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.peers',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-25m', choices=list(MODELS))
    parser.add_argument('--nproc', type=int, default=2, help='world size N')
    parser.add_argument('--steps', type=int, default=30, help='rounds of the interleaved job')
    parser.add_argument('--timed-from', type=int, default=2,
                        help='rounds left out of the step-time ratios (warm-up)')
    parser.add_argument('--batch-size', type=int, default=2, help='sequences per rank per step')
    parser.add_argument('--seq-len', type=int, default=64, help='tokens per sequence')
    parser.add_argument('--memory-steps', type=int, default=8,
                        help='steps of each memory job (the first is left out)')
    parser.add_argument('--memory-repeats', type=int, default=5,
                        help='memory jobs per arm; their measured steps are pooled')
    parser.add_argument('--arms', nargs='+', default=list(ARMS), choices=list(ARMS),
                        metavar='ARM', help=f'a subset of {list(ARMS)}')
    parser.add_argument('--skip-memory', action='store_true', help='only the interleaved job')
    parser.add_argument('--skip-interleaved', action='store_true', help='only the memory jobs')
    parser.add_argument('--timeout', type=float, default=600, help='seconds per memory job')
    records.add_output_options(parser, 'peers')
    args = parser.parse_args(argv)
    if args.memory_repeats < 1 or args.memory_steps < 2 or args.steps <= args.timed_from:
        parser.error('needs --memory-repeats >= 1, --memory-steps >= 2, --steps > --timed-from')
    common = dict(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len)
    results: List[Dict[str, Any]] = []
    arms = list(args.arms)
    if not args.skip_memory:
        for repeat in range(args.memory_repeats):
            for arm in list(arms):
                case = dict(common, mode='memory', arms=[arm], steps=args.memory_steps,
                            name=f'peers/memory/{arm} #{repeat + 1}')
                results.append(_job(case, args.nproc, True, args.timeout))
                records.save_results(args.out, results)
                if 'job_failed' in results[-1] or not all(r['ok'] for r in results[-1]['ranks']):
                    arms.remove(arm)  # an arm that failed once is not run again
    if not args.skip_interleaved and arms:
        case = dict(common, mode='interleaved', arms=arms, steps=args.steps,
                    timed_from=args.timed_from, name='peers/interleaved')
        results.append(_job(case, args.nproc, False, 3 * args.timeout))
        records.save_results(args.out, results)
    if not results:
        parser.error('nothing ran')
    results[0].setdefault('params', parameter_count(args.model))
    records.finish(args, {'peers': records.header('python -m benchmarks.peers') + '\n\n'
                          + report(results)})


if __name__ == '__main__':
    main()
