"""Re-measure the times the README quotes: ``python -m benchmarks.readme_timings``.

Each command runs as the README writes it, from the repository root, with this
interpreter, and is timed wall-clock:

- ``demo``: ``bash tools/dist_train.sh configs/gpt-nano_fsdp_2xcpu.py 2`` (the
  whole 300-iteration demo on 2 processes; into a temporary work directory);
- ``plan``: ``python -m mmfsdp.plan`` of the 1B-parameter variant of the demo GPT
  at world sizes 1, 8 and 64, interpreter start-up included;
- ``suite`` (``--with-suite``): ``python -m pytest -q``, the whole test suite;
- ``install`` (``--with-install``): the Quick start's
  ``python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e .``, into a
  temporary directory (needs the package index; pip's cache makes it faster).

Times depend on what else the machine runs, so the load average is recorded
before and after each command, with the machine (CPU model, cores, memory),
the versions, the commit and the date. Prints a Markdown table; ``--out``
writes the same as JSON.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

from .launch import REPO
from .record import machine, utc_now

__all__ = ['main', 'measure']

PLAN_1B = ['--cfg-options', 'model.n_layer=26', 'model.n_embd=1792', 'model.n_head=28']


def _commands(work_dir: str) -> Dict[str, List[str]]:
    python = sys.executable
    return dict(
        demo=['bash', 'tools/dist_train.sh', 'configs/gpt-nano_fsdp_2xcpu.py', '2',
              '--work-dir', os.path.join(work_dir, 'demo')],
        plan=[python, '-m', 'mmfsdp.plan', 'configs/gpt-nano_fsdp_2xcpu.py', '--world-size',
              '1', '8', '64', *PLAN_1B],
        suite=[python, '-m', 'pytest', '-q', '-p', 'no:cacheprovider'],
        install=['bash', '-c', f'python3 -m venv {work_dir}/venv && {work_dir}/venv/bin/pip '
                               f'install -q torch==2.13.0 -e {REPO}'],
    )


def _free_port() -> int:
    """A free local port for torchrun's rendezvous (another job may hold 29500)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _load_average() -> float:
    return round(os.getloadavg()[0], 2)


def measure(name: str, cmd: List[str]) -> Dict[str, Any]:
    """Run ``cmd`` from the repository root; its wall time, exit code and the load around it."""
    env = dict(os.environ, PYTHON=sys.executable, PORT=str(_free_port()))
    before = _load_average()
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - start
    result = dict(name=name, command=' '.join(cmd), wall_s=round(wall, 1),
                  returncode=done.returncode, load_before=before, load_after=_load_average())
    if done.returncode != 0:
        result['stderr_tail'] = done.stderr[-2000:]
    return result


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog='python -m benchmarks.readme_timings',
                                     description=__doc__.split('\n\n')[0])
    parser.add_argument('--with-suite', action='store_true', help='also time the test suite')
    parser.add_argument('--with-install', action='store_true',
                        help='also time the Quick start install into a fresh venv')
    parser.add_argument('--out', help='write the results as JSON to this file')
    args = parser.parse_args()
    names = ['demo', 'plan'] + ['suite'] * args.with_suite + ['install'] * args.with_install
    with tempfile.TemporaryDirectory() as work_dir:
        commands = _commands(work_dir)
        data = dict(date_utc=utc_now(),
                    machine=machine(), results=[])
        for name in names:
            print(f'{name}: {" ".join(commands[name])}', file=sys.stderr, flush=True)
            data['results'].append(measure(name, commands[name]))
    m = data['machine']
    print(f"Measured {data['date_utc']} on {m['cpu']} ({m['cores']} cores, "
          f"{m['memory_gib']} GiB), torch {m['versions']['torch']}, mmengine "
          f"{m['versions']['mmengine']}, commit {m['commit']}\n")
    print('| what | wall time | exit code | load average before / after |')
    print('|---|---|---|---|')
    for r in data['results']:
        print(f"| {r['name']} | {r['wall_s']} s | {r['returncode']} | "
              f"{r['load_before']} / {r['load_after']} |")
    if args.out:
        with open(args.out, 'w') as f:
            json.dump(data, f, indent=1)


if __name__ == '__main__':
    main()
