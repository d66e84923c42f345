"""Raw results, Markdown tables and the marked blocks of ``docs/benchmarks.md``.

Every script writes its raw results as JSON under ``work_dirs/benchmarks/``
(ignored by git) and prints its tables; with ``--write-docs`` it also replaces
its blocks of ``docs/benchmarks.md``, the text between ``<!-- begin: NAME -->``
and ``<!-- end: NAME -->``. The prose around the blocks is written by hand.
"""
import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Dict, Iterable, List, Optional, Sequence

from .launch import REPO

DOCS = os.path.join(REPO, 'docs', 'benchmarks.md')
RESULTS_DIR = os.path.join(REPO, 'work_dirs', 'benchmarks')
MIB = 2**20


def utc_now() -> str:
    """The time now, ``'YYYY-MM-DD HH:MM UTC'``."""
    return time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())


def machine_line() -> str:
    """The machine, versions and commit in one line (without importing torch)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next((line.split(':', 1)[1].strip() for line in f
                        if line.startswith('model name')), cpu)
    except OSError:
        pass
    versions = []
    for package in ('torch', 'mmengine'):
        try:
            versions.append(f'{package} {version(package)}')
        except PackageNotFoundError:
            pass
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, text=True,
                            capture_output=True).stdout.strip() or 'unknown'
    dirty = subprocess.run(['git', 'status', '--porcelain', '--', 'mmfsdp'], cwd=REPO,
                           text=True, capture_output=True).stdout.strip()
    dirty = '+uncommitted mmfsdp changes' if dirty else ''
    return (f'{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, '
            f"{', '.join(versions)}, commit {commit}{dirty}")


def header(prog: str) -> str:
    """The first line of a block: the command that ran (``prog`` and this process's
    arguments), when and where."""
    command = ' '.join([prog] + [shlex.quote(a) for a in sys.argv[1:]])
    return f'`{command}` on {utc_now()}: {machine_line()}.'


def write_block(path: str, name: str, text: str) -> None:
    """Replace what lies between the ``name`` markers of ``path`` with ``text``."""
    begin, end = f'<!-- begin: {name} -->', f'<!-- end: {name} -->'
    with open(path) as f:
        doc = f.read()
    if doc.count(begin) != 1 or doc.count(end) != 1:
        raise ValueError(f'{path} needs exactly one {begin} ... {end} block')
    head, rest = doc.split(begin, 1)
    with open(path, 'w') as f:
        f.write(f'{head}{begin}\n{text.strip()}\n{end}{rest.split(end, 1)[1]}')


def add_output_options(parser: argparse.ArgumentParser, name: str) -> None:
    """``--out`` (raw JSON) and ``--write-docs [PATH]`` (the blocks in the docs page)."""
    parser.add_argument('--out', default=os.path.join(RESULTS_DIR, f'{name}.json'),
                        help='raw results, JSON (default: %(default)s)')
    parser.add_argument('--write-docs', nargs='?', const=DOCS, metavar='PATH',
                        help=f'replace this script\'s blocks in PATH (default: {DOCS})')


def load_results(path: str) -> List[Dict[str, Any]]:
    """The results saved at ``path`` (none when it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)['results']


def save_results(path: str, results: List[Dict[str, Any]], **extra: Any) -> None:
    """Write ``results`` (and ``extra``) as JSON to ``path`` atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + '.tmp', 'w') as f:
        json.dump(dict(extra, results=results), f, indent=1)
    os.replace(path + '.tmp', path)


def finish(args: argparse.Namespace, blocks: Dict[str, str]) -> None:
    """Print every block; with ``--write-docs``, replace them in the docs page."""
    for name, text in blocks.items():
        print(f'<!-- {name} -->\n{text}\n')
        if args.write_docs:
            write_block(args.write_docs, name, text)


def table(columns: Sequence[str], rows: Iterable[Sequence[Any]],
          align: Optional[str] = None) -> str:
    """A Markdown table; ``align`` is the separator row's cells (default ``---``)."""
    lines = ['| ' + ' | '.join(columns) + ' |',
             '|' + '|'.join([align or '---'] * len(columns)) + '|']
    lines += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
    return '\n'.join(lines)


def mib(n: float, digits: int = 1) -> str:
    """Bytes as MiB with thousands separators."""
    return f'{n / MIB:,.{digits}f}'


def spread(s: Dict[str, float], fmt: str = '{:.2f}', scale: float = 1.0) -> str:
    """``median (min–max)`` of a :func:`~benchmarks.core.measure.summary`; the median alone
    when they are equal."""
    values = [fmt.format(s[k] * scale) for k in ('median', 'min', 'max')]
    return values[0] if values[1] == values[2] else f'{values[0]} ({values[1]}–{values[2]})'
