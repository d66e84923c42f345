"""The torchrun entry point of every measurement: ``python -m benchmarks.worker --cases JSON``.

Started by :func:`benchmarks.launch.torchrun` as
``python -m torch.distributed.run --standalone --nproc-per-node N -m benchmarks.worker``.
It starts the process group (gloo on CPU), runs each case in turn and prints
one ``RESULT <json>`` line per case from rank 0. The suite gives each
measurement its own job, so that a process's memory belongs to one case;
only the smoke test packs several cases into one job.
"""
import argparse
import json
import sys

import torch
import torch.distributed as dist

from mmfsdp.dist import init_distributed, shutdown_distributed

from . import (
    accumulation,
    agreement,
    async_save,
    checkpoint_cost,
    construction,
    memory,
    overhead,
    peak_truth,
    peers,
    tensor_peaks,
)
from .job import dump_stacks_on_signal
from .workload import threads_per_rank

KINDS = dict(memory=memory.run_case, overhead=overhead.run_case,
             construction=construction.run_case, checkpoint=checkpoint_cost.run_case,
             agreement=agreement.run_case, peers=peers.run_case,
             accumulation=accumulation.run_case, peak=peak_truth.run_case,
             tensor_peak=tensor_peaks.run_case, async_save=async_save.run_case)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--cases', required=True, help='JSON list of cases')
    args = parser.parse_args()
    cases = json.loads(args.cases)
    dump_stacks_on_signal()  # a job past its deadline says where it hung
    init_distributed('pytorch', dict(timeout=900))
    torch.set_num_threads(threads_per_rank(dist.get_world_size()))
    try:
        for case in cases:
            result = KINDS[case['kind']](case)
            if dist.get_rank() == 0:
                print('RESULT ' + json.dumps(result), flush=True)
            dist.barrier()
    finally:
        shutdown_distributed()


if __name__ == '__main__':
    sys.exit(main())
