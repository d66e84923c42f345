"""What a benchmark run records: the machine and versions it ran on, and its results file."""
import json
import os
import platform
import re
import subprocess
import time
from typing import Any, Dict, Optional

from .launch import REPO

__all__ = ['machine', 'save_results', 'utc_now']


def utc_now() -> str:
    """The time now as results files record it, ``'YYYY-MM-DD HH:MM UTC'``: such stamps sort
    as they read, so the report can tell which of two runs is newer."""
    return time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--', 'mmfsdp'], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return out + ('+uncommitted mmfsdp changes' if dirty else '')
    except (OSError, subprocess.CalledProcessError):
        return None


def machine() -> Dict[str, Any]:
    """The machine and versions, without importing torch."""
    from importlib.metadata import PackageNotFoundError, version
    cpu = platform.processor()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next((line.split(':', 1)[1].strip() for line in f
                        if line.startswith('model name')), cpu)
        with open('/proc/meminfo') as f:
            mem_kib = int(f.readline().split()[1])
    except OSError:
        mem_kib = 0
    versions = {}
    for package in ('torch', 'mmengine', 'mmfsdp'):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = None
    if versions['mmfsdp'] is None:  # run from a checkout without installing it
        with open(os.path.join(REPO, 'mmfsdp', 'release.py')) as f:
            found = re.search(r"__version__ = '([^']+)'", f.read())
        versions['mmfsdp'] = found.group(1) if found else None
    return dict(cpu=cpu, cores=os.cpu_count(), memory_gib=round(mem_kib / 2**20, 1),
                python=platform.python_version(), platform=platform.platform(),
                versions=versions, commit=_git_commit())


def save_results(path: str, data: Dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a stopped run leaves the previous file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
