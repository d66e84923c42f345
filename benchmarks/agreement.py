"""Issue 14: what the rank-agreement check costs, against building the model it checks.

``python -m benchmarks.agreement [--model gpt-100m] [--nproc 2]`` starts one
torchrun job. Each rank builds the model through ``FSDPRunner`` with the
FSDP2 wrapper (one unit per block) and ``train()`` runs with zero iterations,
so everything up to the first step happens: that wall time is the
construction time. Then :func:`mmfsdp.together.check_ranks_agree` (fingerprint
of names, shapes, dtypes, wrapper config, sharding, unit plan; one all_gather
of 8-byte digests) runs ``repeats`` times on the unwrapped model of the same
preset; the median is its cost. The check runs once inside the construction too.
"""
import argparse
import json
import statistics
import tempfile
import time
from typing import Any, Dict, List

__all__ = ['run_case']


def run_case(case: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    from mmfsdp.together import check_ranks_agree, fingerprint
    from mmfsdp.wrappers.builder import resolve_wrapper

    from .workload import STRATEGIES, build_model, make_runner, runner_cfg
    wrapper_cfg = dict(STRATEGIES['FSDP2 reshard'].wrapper_cfg)
    with tempfile.TemporaryDirectory(prefix='mmfsdp-bench-') as work_dir:
        dist.barrier()
        start = time.perf_counter()
        runner = make_runner(runner_cfg(case['model'], wrapper_cfg, work_dir, 'agreement',
                                        1, 16, 0))
        runner.train()
        dist.barrier()
        construction_s = time.perf_counter() - start
        del runner
    model = build_model(case['model'])
    wrapping = resolve_wrapper(wrapper_cfg)
    layout = wrapping.layout(model)
    times: List[float] = []
    for _ in range(case.get('repeats', 10)):
        dist.barrier()
        start = time.perf_counter()
        check_ranks_agree(model, wrapping, layout)
        times.append(time.perf_counter() - start)
    fields = fingerprint(model, wrapping, layout, dist.get_world_size())
    check_s = statistics.median(times)
    return dict(kind='agreement', model=case['model'], world_size=dist.get_world_size(),
                params=sum(p.numel() for p in model.parameters()),
                fingerprint_lines={k: len(v) for k, v in fields.items()},
                construction_s=construction_s, check_s=check_s, check_s_all=times,
                check_fraction=check_s / construction_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m')
    parser.add_argument('--nproc', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=10)
    args = parser.parse_args()
    from .launch import torchrun
    [result] = torchrun([dict(kind='agreement', model=args.model, repeats=args.repeats)],
                        args.nproc, exact_allocator=False)
    print(json.dumps(result, indent=1))


if __name__ == '__main__':
    main()
