"""Checkpoint cost at world size 2: save / load time, size, rank-0 peak memory.

Usage::

    python -m benchmarks.checkpoint_cost [--layers 8 --width 768 --repeats 3]

Each checkpoint type is measured in its own torchrun job (2 CPU processes,
gloo), so that a process's peak RSS belongs to one type. The model is the demo
GPT with FSDP1 FULL_SHARD per TransformerBlock and AdamW state after one step.
Prints one JSON line per type and appends a table to ``docs/benchmarks.md``
when ``--report`` is given.
"""
import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

TYPES = ('full', 'sharded')


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _dir_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def worker(kind: str, layers: int, width: int, repeats: int, work_dir: str) -> None:
    """One torchrun rank: build, step once, then save and load ``repeats`` times."""
    import torch
    import torch.distributed as dist
    from mmengine.config import Config

    import mmfsdp
    from mmfsdp.dist import init_distributed
    torch.set_num_threads(1)
    init_distributed('pytorch', dict(timeout=600))
    cfg = Config(dict(
        model=dict(type='mmfsdp.GPT', vocab_size=256, block_size=64, n_layer=layers,
                   n_head=max(1, width // 64), n_embd=width),
        work_dir=work_dir, launcher='pytorch', log_level='WARNING',
        experiment_name=f'ckpt-{kind}',
        runner_type='mmfsdp.FSDPRunner',
        model_wrapper_cfg=dict(type='mmfsdp.MMFullyShardedDataParallel',
                               auto_wrap_policy=dict(type='transformer',
                                                     layer_cls=['TransformerBlock'])),
        train_dataloader=dict(dataset=dict(type='mmfsdp.StdlibCharDataset', block_size=64,
                                           max_chars=200_000),
                              sampler=dict(type='DefaultSampler', shuffle=True),
                              collate_fn=dict(type='default_collate'), batch_size=2),
        train_cfg=dict(by_epoch=False, max_iters=1),
        optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-4)),
        default_hooks=dict(checkpoint=None)))
    runner = mmfsdp.FSDPRunner.from_cfg(cfg)
    runner.train()
    params = torch.tensor(sum(p.numel() for p in runner.model.parameters()))
    dist.all_reduce(params)  # the local shards add up to the model
    world = dist.get_world_size()
    before = _peak_rss_mib()
    saves, loads = [], []
    path = os.path.join(work_dir, 'iter_1.pth')
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        runner.save_checkpoint(work_dir, 'iter_1.pth', by_epoch=False, state_dict_type=kind)
        saves.append(time.perf_counter() - start)
    after_save = _peak_rss_mib()
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        runner.resume(path)
        dist.barrier()
        loads.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print('RESULT ' + json.dumps(dict(
            type=kind, params=int(params), world_size=world,
            save_s=statistics.median(saves), save_range=[min(saves), max(saves)],
            load_s=statistics.median(loads), load_range=[min(loads), max(loads)],
            bytes=_dir_size(path), rank0_peak_rss_mib_before=before,
            rank0_peak_rss_mib_save=after_save,
            rank0_peak_rss_mib_load=_peak_rss_mib())), flush=True)


def measure(kind: str, layers: int, width: int, repeats: int) -> dict:
    """Run one torchrun job for ``kind``; return its result."""
    work_dir = tempfile.mkdtemp(prefix=f'mmfsdp-ckpt-{kind}-')
    try:
        out = subprocess.run(
            [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node',
             '2', '-m', 'benchmarks.checkpoint_cost', '--worker', kind, '--layers', str(layers),
             '--width', str(width), '--repeats', str(repeats), '--work-dir', work_dir],
            check=True, capture_output=True, text=True).stdout
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    line = next(line for line in out.splitlines() if line.startswith('RESULT '))
    return json.loads(line[len('RESULT '):])


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--layers', type=int, default=8)
    parser.add_argument('--width', type=int, default=768)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--worker', choices=TYPES)
    parser.add_argument('--work-dir')
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.layers, args.width, args.repeats, args.work_dir)
        return
    for kind in TYPES:
        print(json.dumps(measure(kind, args.layers, args.width, args.repeats)), flush=True)


if __name__ == '__main__':
    main()
