"""Regional compile under multi-scale inputs: ``python -m benchmarks.compile_multiscale``.

A small conv detector backbone (stem and two stages of bottlenecks, 4 kinds of block),
fp32, FSDP2 over 2 CPU ranks (gloo), one unit per block, the sizes a multi-scale pipeline
draws (``--sizes`` of (H, W), multiples of 32, cycled). Eager and regional compile
(``regional_compile=dict(layer_cls=['Bottleneck'])``, inductor, ``dynamic=False``) run in
the same 2 processes, interleaved step by step, each from an empty inductor cache: the
first iteration, the steady step (median over the steps after every size was seen, the
slowest rank) and the graphs compiled. Block: ``compile_multiscale``.
"""
import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.multiprocessing as mp

from .core import records

NPROC = 2
SIZES = ((256, 320), (288, 352), (320, 384), (352, 416))


def _rank(rank: int, port: int, sizes: List[tuple], rounds: int, out: str) -> None:
    import torch.distributed as dist
    from torch._dynamo import lookup_backend, register_backend

    from mmfsdp import MMFullyShard
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'tests', 'support'))
    from vision import BottleneckResNet
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(NPROC), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group('gloo')
    graphs = [0]

    @register_backend(name='inductor_counted')
    def counted(graph, example_inputs):
        graphs[0] += 1
        return lookup_backend('inductor')(graph, example_inputs)

    models = {}
    for arm, extra in (('eager', {}), ('regional compile', dict(regional_compile=dict(
            layer_cls=['Bottleneck'], backend='inductor_counted')))):
        torch.manual_seed(0)
        models[arm] = MMFullyShard.from_options(
            BottleneckResNet(width=8, depths=(2, 2)),
            auto_wrap_policy=dict(type='transformer', layer_cls=['Bottleneck']), **extra)
    times: Dict[str, List[float]] = {arm: [] for arm in models}
    for step in range(rounds * len(sizes)):
        x = torch.randn(2, 3, *sizes[step % len(sizes)])
        for arm, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            model(x).sum().backward()
            dist.barrier()
            times[arm].append(time.perf_counter() - start)
    if rank == 0:
        torch.save(dict(times=times, graphs=graphs[0]), out)
    dist.destroy_process_group()


def measure(sizes: List[tuple], rounds: int) -> Dict[str, Any]:
    """Both arms, interleaved, in one 2-process group; returns times and graphs."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ['TORCHINDUCTOR_CACHE_DIR'] = os.path.join(tmp, 'inductor')
        out = os.path.join(tmp, 'result.pt')
        mp.spawn(_rank, (port, sizes, rounds, out), nprocs=NPROC)
        return torch.load(out)


def table(result: Dict[str, Any], sizes: List[tuple], load: tuple) -> str:
    rows, n = [], len(sizes)
    for arm, t in result['times'].items():
        steady = t[n:]
        rows.append([arm, f'{t[0]:.2f}', f'{sum(t[:n]):.1f}', f'{statistics.median(steady):.3f} '
                     f'({min(steady):.3f}–{max(steady):.3f})',
                     str(result['graphs']) if arm != 'eager' else '0'])
    return '\n\n'.join([
        records.header('python -m benchmarks.compile_multiscale') + f' FSDP2 over {NPROC} '
        f'ranks (gloo), fp32, inductor; sizes {", ".join(f"{h}x{w}" for h, w in sizes)}, '
        f'batch 2; load (1 min) {load[0]:.1f} → {load[1]:.1f}.',
        records.table(['arm', 'first iteration s', 'first round (every size once) s',
                       'steady step s, median (min–max)', 'graphs'], rows)])


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.compile_multiscale',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--rounds', type=int, default=3, help='passes over the sizes')
    records.add_output_options(parser, 'compile_multiscale')
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    result = measure(list(SIZES), args.rounds)
    records.save_results(args.out, [dict(result, sizes=SIZES)])
    records.finish(args, {'compile_multiscale': table(result, list(SIZES),
                                                      (load, os.getloadavg()[0]))})


if __name__ == '__main__':
    main()
