"""Job control for launched jobs (tests/support/job.py): no process of a job outlives it.

A launcher such as torchrun starts its workers in sessions of their own; the
launchers here do the same with a process that would run for ten minutes.
"""
import os
import sys

from harness import REPO, SUPPORT
from job import Job, marked_processes

LAUNCHER = ('import subprocess, sys\n'
            'child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],'
            ' start_new_session=True)\n'
            'print("worker", child.pid, flush=True)\n'
            'sys.exit({code})\n')


def _launcher(code: int = 0):
    return [sys.executable, '-c', LAUNCHER.format(code=code)]


def _worker_pid(job: Job, i: int = 0) -> int:
    return int(job.stdout(i).split()[1])


def test_workers_a_launcher_leaves_behind_are_killed_and_reported():
    # The worker holds the job's output open: waiting must end when the launcher does.
    with Job([_launcher(code=3)], dict(os.environ), os.getcwd()) as job:
        assert job.wait(timeout=120)
        assert job.returncodes == [3]
        assert job.left_behind == [_worker_pid(job)]
        assert marked_processes(job.mark) == []


def test_a_job_past_its_deadline_is_killed_whole():
    with Job([[sys.executable, '-c', 'import time; time.sleep(600)'], _launcher()],
             dict(os.environ), os.getcwd()) as job:
        assert not job.wait(timeout=1)
        assert job.returncodes[0] == -9
        assert marked_processes(job.mark) == []


def test_a_job_that_ends_cleanly_leaves_nothing_and_keeps_its_output():
    code = 'import sys; print("out"); print("err", file=sys.stderr)'
    with Job([[sys.executable, '-c', code]], dict(os.environ), os.getcwd(),
             merge_stderr=False) as job:
        assert job.wait(timeout=120)
        assert (job.returncodes, job.left_behind) == ([0], [])
        assert (job.stdout(), job.stderr()) == ('out\n', 'err\n')


def test_a_job_past_its_deadline_first_writes_where_its_workers_are():
    worker = ('from job import dump_stacks_on_signal\n'
              'dump_stacks_on_signal()\n'
              'def waiting_for_a_peer():\n'
              '    import time; time.sleep(600)\n'
              'print("ready", flush=True)\n'
              'waiting_for_a_peer()\n')
    launcher = ('import subprocess, sys\n'
                f'subprocess.run([sys.executable, "-c", {worker!r}])\n')
    env = dict(os.environ, PYTHONPATH=str(SUPPORT))
    with Job([[sys.executable, '-c', launcher]], env, str(REPO)) as job:
        assert not job.wait(timeout=15)  # ample for the worker to start and register
        assert 'ready' in job.stdout()
        assert 'in waiting_for_a_peer' in job.stdout()
