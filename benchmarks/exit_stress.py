"""Issue 14: finished jobs exit cleanly. ``python -m benchmarks.exit_stress [--jobs 50]``.

Runs ``--jobs`` short 2-rank torchrun jobs back to back, each a complete
``tools/train.py``-like run of ``FSDPRunner`` (the tiny demo GPT under FSDP2:
a few iterations, one validation-free full checkpoint at the end) that leaves
the process group to the runner, which destroys it at exit. A job is abnormal
if torchrun exits non-zero or any rank prints ``terminate called`` (the
SIGABRT seen when gloo groups are left alive at exit). Prints one JSON object
with the counts and the exit codes of abnormal jobs.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .launch import REPO

JOB = 'benchmarks.exit_stress'


def _job(work_dir: str, iters: int) -> None:
    from .workload import make_runner, runner_cfg
    cfg = runner_cfg('gpt-tiny', dict(type='mmfsdp.MMFullyShard',
                                      auto_wrap_policy=dict(type='transformer',
                                                            layer_cls=['TransformerBlock'])),
                     work_dir, 'exit-stress', 2, 16, iters)
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=-1, by_epoch=False,
                                        save_last=True)
    cfg.env_cfg = dict(dist_cfg=dict(timeout=120))
    make_runner(cfg).train()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--jobs', type=int, default=50)
    parser.add_argument('--iters', type=int, default=2)
    parser.add_argument('--job', help=argparse.SUPPRESS)  # inside torchrun: one job
    args = parser.parse_args()
    if args.job:
        _job(args.job, args.iters)
        return
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (REPO, os.environ.get('PYTHONPATH')) if p), OMP_NUM_THREADS='1')
    abnormal, start = [], time.monotonic()
    for i in range(args.jobs):
        with tempfile.TemporaryDirectory(prefix='mmfsdp-exit-') as work_dir:
            proc = subprocess.run(
                [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                 '--nproc-per-node', '2', '-m', JOB, '--job', work_dir,
                 '--iters', str(args.iters)],
                cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode or 'terminate called' in proc.stderr:
            abnormal.append(dict(job=i, returncode=proc.returncode,
                                 tail=proc.stderr.splitlines()[-5:]))
        print(f'job {i}: exit {proc.returncode}', file=sys.stderr, flush=True)
    print(json.dumps(dict(jobs=args.jobs, abnormal=len(abnormal), details=abnormal,
                          wall_s=round(time.monotonic() - start, 1)), indent=1))


if __name__ == '__main__':
    main()
