"""A sharded save into a directory that the ranks do not share is refused before writing.

Two real processes stand for two nodes with node-local disks: each works in
its own folder (``node0/``, ``node1/``), so the same relative ``work/`` names
a different real directory on each rank, as ``/local/work`` does on two
machines. The first sharded save there must refuse on every rank with one
message and leave nothing behind; into a directory both see, it works.
"""
import os

import torch
import torch.distributed as dist

from harness import COLLECTIVE_TIMEOUT_S, raised, run_distributed


def _saves(root: str) -> dict:
    import datetime

    from mmfsdp.checkpoint.state import is_sharded_checkpoint, save_sharded
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    model = torch.nn.Linear(4, 2)
    node = os.path.join(root, f'node{rank}')
    os.makedirs(os.path.join(node, 'work'))
    os.chdir(node)  # 'work/...' is now this node's own disk
    local = raised(lambda: save_sharded('work/iter_1.pth', model, None, {}, token='runtest'))
    shared = raised(lambda: save_sharded(os.path.join(root, 'shared', 'iter_1.pth'), model, None,
                                         {}, token='runtest'))
    return dict(local=local, local_files=sorted(os.listdir(os.path.join(node, 'work'))),
                shared=shared, shared_ok=is_sharded_checkpoint(
                    os.path.join(root, 'shared', 'iter_1.pth')),
                shared_files=sorted(os.listdir(os.path.join(root, 'shared'))))


def test_sharded_save_refuses_a_work_dir_the_ranks_do_not_share(tmp_path):
    results = run_distributed(_saves, 2, str(tmp_path))
    kinds = {r['local'][0] for r in results}
    messages = {r['local'][1] for r in results}
    assert kinds == {'ValueError'} and len(messages) == 1  # one message, every rank
    message = messages.pop()
    assert "state_dict_type='sharded'" in message and 'rank 1 did not see' in message
    assert 'node1' in message  # where rank 1 looked
    assert "'full'" in message and 'Nothing was written' in message
    assert [r['local_files'] for r in results] == [[], []]  # no shard, no marker
    # a directory both ranks see: the check passes and the checkpoint is written
    assert [r['shared'] for r in results] == [(None, None), (None, None)]
    assert results[0]['shared_ok'] and results[0]['shared_files'] == ['iter_1.pth']
