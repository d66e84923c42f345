"""A sharded checkpoint written under one supported torch loads under another, both ways.

Needs a second environment: ``MMFSDP_OTHER_TORCH_PYTHON`` names the interpreter of another
torch with mmengine (``tools/test_torch.sh VERSION unit`` makes one:
``.venv-torch<VERSION>/bin/python``); skipped without it. Each direction is two jobs: one
interpreter trains and saves, the other resumes; the weights it holds equal the saved ones.
"""
import json
import os
import subprocess
import sys

import pytest

from harness import REPO, SUPPORT, free_port, job_env, run_job

OTHER = os.environ.get('MMFSDP_OTHER_TORCH_PYTHON')
pytestmark = pytest.mark.skipif(
    not OTHER, reason='MMFSDP_OTHER_TORCH_PYTHON names no second torch environment '
    '(tools/test_torch.sh VERSION unit creates one)')


def _job(python: str, mode: str, work_dir: str) -> dict:
    out = run_job([python, '-m', 'torch.distributed.run', '--nproc-per-node', '2',
                   '--master-addr', '127.0.0.1', '--master-port', str(free_port()),
                   str(SUPPORT / 'cross_torch_job.py'), mode, work_dir],
                  env=job_env(REPO), merge_stderr=False)
    return json.loads(out.strip().splitlines()[-1])


def _version(python: str) -> str:
    return subprocess.run([python, '-c', 'import torch; print(torch.__version__)'],
                          capture_output=True, text=True, check=True, timeout=120).stdout.strip()


@pytest.mark.parametrize('direction', ['written-here', 'written-there'])
def test_a_sharded_checkpoint_loads_under_the_other_torch(tmp_path, direction):
    """written-here: this interpreter's torch saves, the other's resumes; written-there: back."""
    writer, reader = ((sys.executable, OTHER) if direction == 'written-here'
                      else (OTHER, sys.executable))
    assert _version(writer) != _version(reader), 'both interpreters have the same torch'
    saved = _job(writer, 'save', str(tmp_path))
    loaded = _job(reader, 'load', str(tmp_path))
    assert (saved['torch'], loaded['torch']) == (_version(writer), _version(reader))
    assert loaded['iter'] == saved['iter'] == 2
    assert loaded['model'] == saved['model'], \
        f"torch {loaded['torch']} resumed other weights than torch {saved['torch']} saved"
