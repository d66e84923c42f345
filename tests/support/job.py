"""Start a launcher job and account for every process it starts, on Linux.

A torchrun agent starts each worker in a session of its own, so killing the
agent's process group leaves the workers running; and if the agent dies
first, its orphaned workers keep its output pipes open, so a caller that
reads the job's output until end-of-file waits forever. A :class:`Job`
therefore

- marks every process of the job through one environment variable
  (:data:`MARK`, inherited by the agent, its workers and theirs), and finds
  them in ``/proc`` whatever became of their parent;
- writes the job's output to files, so that waiting ends when the launcher
  exits, not when the last process holding its output does;
- kills the whole job past its deadline, and whatever it left running when
  its launcher exited on its own; past the deadline, every process first gets
  :data:`DUMP_SIGNAL`, on which a process that registered it with
  :func:`dump_stacks_on_signal` writes every thread's Python stack to its
  stderr, so the output says where the job hung.

Used by the tests' :func:`harness.run_job` and by their multi-node jobs.
"""
import faulthandler
import os
import signal
import subprocess
import tempfile
import time
import uuid
from typing import Dict, List, Optional, Sequence

__all__ = ['DUMP_SIGNAL', 'Job', 'MARK', 'dump_stacks_on_signal', 'marked_processes']

#: The environment variable every process of a job inherits, with the job's own value.
MARK = 'MMFSDP_JOB_MARK'
#: Sent to a job's processes past its deadline, before they are killed.
DUMP_SIGNAL = signal.SIGUSR1
#: How long the processes get to write their stacks.
DUMP_GRACE_S = 3.0


def dump_stacks_on_signal() -> None:
    """In a process of a job: on :data:`DUMP_SIGNAL`, write every thread's stack to stderr."""
    faulthandler.register(DUMP_SIGNAL, all_threads=True)


def marked_processes(mark: str) -> List[int]:
    """The processes whose environment carries ``MMFSDP_JOB_MARK=mark``."""
    needle = f'{MARK}={mark}'.encode()
    found = []
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open(f'/proc/{entry}/environ', 'rb') as f:
                if needle in f.read().split(b'\0'):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


class Job:
    """One or more launcher commands started together as one job.

    Args:
        cmds: The commands (one per launcher, e.g. one torchrun agent per node).
        env: Their environment; :data:`MARK` is added to it.
        cwd: Their working directory.
        merge_stderr: Write stderr into the same file as stdout.

    Example::

        job = Job([['torchrun', '--nproc-per-node', '2', 'train.py']], env, cwd)
        finished = job.wait(timeout=240)     # False: past the deadline, every process killed
        print(job.returncodes, job.left_behind, job.stdout(0))
    """

    def __init__(self, cmds: Sequence[Sequence[str]], env: Dict[str, str], cwd: str,
                 merge_stderr: bool = True) -> None:
        self.mark = uuid.uuid4().hex
        env = dict(env, **{MARK: self.mark})
        self._out = [tempfile.TemporaryFile('w+') for _ in cmds]
        self._err = [None if merge_stderr else tempfile.TemporaryFile('w+') for _ in cmds]
        self._procs = [subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=out,
                                        stderr=subprocess.STDOUT if err is None else err,
                                        text=True, start_new_session=True)
                       for cmd, out, err in zip(cmds, self._out, self._err)]
        #: Processes of the job still running after its launchers ended (killed).
        self.left_behind: List[int] = []

    def wait(self, timeout: float) -> bool:
        """Wait until every launcher exits; ``False`` if the deadline came first.

        Either way, no process of the job runs afterwards: past the deadline
        all are killed, and processes a launcher left behind (its workers,
        when it died before them) are killed and listed in :attr:`left_behind`.
        """
        deadline = time.monotonic() + timeout
        finished = True
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                finished = False
                self._dump_stacks()
                break
        killed = self._kill_marked()
        if finished:
            self.left_behind = killed
        for proc in self._procs:
            proc.wait()
        return finished

    def _dump_stacks(self) -> None:
        """Ask the job's workers for their stacks (:data:`DUMP_SIGNAL`), and give them time.

        Launchers (whose own stacks say nothing) are left out: the signal's
        default action would end them, and their workers with them.
        """
        launchers = {proc.pid for proc in self._procs}
        for pid in marked_processes(self.mark):
            if pid not in launchers:
                try:
                    os.kill(pid, DUMP_SIGNAL)
                except ProcessLookupError:
                    continue
        time.sleep(DUMP_GRACE_S)

    def _kill_marked(self) -> List[int]:
        """SIGKILL every marked process, again until a scan finds none it has not killed
        (one may fork while the first scan runs)."""
        killed: List[int] = []
        while True:
            found = [pid for pid in marked_processes(self.mark) if pid not in killed]
            if not found:
                _wait_until_dead(killed)
                return killed
            for pid in found:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended meanwhile
                    continue
                killed.append(pid)

    @property
    def returncodes(self) -> List[Optional[int]]:
        """Each launcher's exit status (negative: the signal that ended it)."""
        return [proc.returncode for proc in self._procs]

    def stdout(self, i: int = 0) -> str:
        """What launcher ``i`` (and its processes) wrote to stdout (and stderr, if merged)."""
        return _read(self._out[i])

    def stderr(self, i: int = 0) -> str:
        """What launcher ``i`` wrote to stderr; empty when merged into stdout."""
        return '' if self._err[i] is None else _read(self._err[i])

    def close(self) -> None:
        """Delete the output files."""
        for f in self._out + [e for e in self._err if e is not None]:
            f.close()

    def __enter__(self) -> 'Job':
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_until_dead(pids: List[int], timeout: float = 30.0) -> None:
    """Return once every process in ``pids`` has exited (a zombie counts as exited)."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f'/proc/{pid}/stat') as f:
                    state = f.read().rsplit(')', 1)[1].split()[0]
            except OSError:  # reaped
                break
            if state in ('Z', 'X'):
                break
            time.sleep(0.01)


def _read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read()
