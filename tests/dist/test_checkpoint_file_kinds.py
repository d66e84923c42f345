"""A sharded checkpoint's own files are read only as regular files of its directory.

Two ranks write a sharded checkpoint in each of two work dirs; copies of the
first get one file replaced: ``.metadata`` by a FIFO (opening it would wait
for a writer that never comes), ``.metadata`` by a symbolic link to
``/dev/zero`` (a read without end), ``mmengine.pth`` by a symbolic link to the
other run's. Auto-resume and ``load_from`` refuse each, on every rank, naming
the path and what it is; nothing blocks (the harness's deadline would fail the
test) and nothing of the file is read.
"""
import os
import shutil

import pytest

from harness import raised, run_distributed
from toy import FSDP2, checkpointing_config

#: case -> (the file of the checkpoint replaced, what replaces it, how the refusal names it)
CASES = {
    'fifo': ('.metadata', lambda path, other: os.mkfifo(path), 'is a FIFO'),
    'dev-zero': ('.metadata', lambda path, other: os.symlink('/dev/zero', path),
                 'is a symbolic link to /dev/zero'),
    'other-run': ('mmengine.pth', lambda path, other: os.symlink(other, path),
                  'is a symbolic link to '),
}


def _runner(work_dir: str, **extra):
    from mmfsdp import FSDPRunner
    return FSDPRunner.from_cfg(checkpointing_config(
        work_dir, FSDP2, 2, global_batch=4, max_iters=2, interval=2, state_dict_type='sharded',
        **extra))


def _reads(root: str) -> dict:
    import torch.distributed as dist
    for run in ('written', 'other'):
        _runner(f'{root}/{run}').train()
    out = {}
    for case, (member, make, _) in CASES.items():
        work_dir = f'{root}/{case}'
        path = f'{work_dir}/iter_2.pth'
        if dist.get_rank() == 0:
            shutil.copytree(f'{root}/written/iter_2.pth', path)
            os.remove(f'{path}/{member}')
            make(f'{path}/{member}', f'{root}/other/iter_2.pth/mmengine.pth')
            with open(f'{work_dir}/last_checkpoint', 'w') as f:
                f.write(path)
        dist.barrier()
        out[case] = {
            'auto-resume': raised(lambda w=work_dir: _runner(w, resume=True).train()),
            'load_from': raised(lambda w=f'{root}/{case}-loaded', p=path: _runner(
                w, load_from=p).train()),
        }
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_reads, 2, str(tmp_path_factory.mktemp('kinds')), timeout=240)


@pytest.mark.parametrize('read', ['auto-resume', 'load_from'])
@pytest.mark.parametrize('case', list(CASES))
def test_a_checkpoint_file_that_is_not_a_regular_file_of_its_directory_is_refused(
        ranks, case, read):
    member, _, named = CASES[case]
    for rank, got in enumerate(ranks):
        kind, message = got[case][read]
        assert kind in ('UnsafeCheckpointError', 'PeerFailure'), (rank, kind, message)
        assert f'iter_2.pth/{member} {named}' in message, (rank, message)
        assert 'Nothing was read from it' in message
