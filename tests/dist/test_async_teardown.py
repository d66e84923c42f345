"""A background sharded write whose process group is torn down: published whole, or not at all.

Two ranks, :data:`ROUNDS` rounds per way of tearing down, each in a process
group of its own (a fresh ``FileStore``): an ``MMFullyShard``-sharded linear
layer is saved with ``save_sharded_in_background`` (what
``runner.save_checkpoint(..., async_save=True)`` does outside ``train()``),
then, at once, the group goes:

- ``shutdown``: mmfsdp's ``shutdown_distributed()`` (what ``FSDPRunner`` runs
  at exit): it first publishes the write, collectively, so every round's
  checkpoint is published and loads the layer's weights exactly;
- ``destroy``: the user's own ``dist.destroy_process_group()``, which mmfsdp
  cannot intercept: a write it cut short must never be published partial
  (each published one loads exactly), and one not published is named in a
  log line of rank 0.

Then each rank runs what the interpreter's exit runs (``publish_at_exit``).
The race is a thread against the main thread: before the fix, 10 rounds of
``destroy`` published 2 partial checkpoints (DCP, finding no group, let each
rank write alone into the same directory) and lost 7, 6 of them silently.
"""
import logging
import os

import pytest
import torch

from harness import COLLECTIVE_TIMEOUT_S, run_distributed

ROUNDS = 10
MODES = ('shutdown', 'destroy')


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _round(root: str, mode: str, index: int) -> dict:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from mmfsdp.checkpoint.background import publish_at_exit
    from mmfsdp.checkpoint.state import save_sharded_in_background
    from mmfsdp.dist import shutdown_distributed
    rank = int(os.environ['RANK'])
    dist.init_process_group('gloo', store=dist.FileStore(f'{root}/store-{mode}-{index}', 2),
                            rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    torch.manual_seed(index)
    layer = torch.nn.Linear(64, 64)
    truth = layer.weight.detach().clone()
    fully_shard(layer, mesh=init_device_mesh('cpu', (2,)))
    path = f'{root}/{mode}-{index}/iter_2.pth'
    save_sharded_in_background(path, layer, None, dict(meta=dict(iter=2)), wait_s=20,
                               token=f'run{index:08x}')
    if mode == 'shutdown':
        shutdown_distributed()
    else:
        dist.destroy_process_group()
    publish_at_exit()  # what the interpreter's exit runs
    return dict(path=path, truth=truth)


def _rounds(root: str) -> dict:
    from mmengine.logging import MMLogger
    lines = _Lines()
    MMLogger.get_current_instance().addHandler(lines)
    out = {}
    for mode in MODES:
        for index in range(ROUNDS):
            before = len(lines.lines)
            got = _round(root, mode, index)
            out[f'{mode}-{index}'] = dict(got, lines=lines.lines[before:])
    return out


def _outcome(got: dict) -> dict:
    """Whether the round's checkpoint was published, and how far its weight is off."""
    from mmfsdp.checkpoint.safe_io import read_all_shards
    if not os.path.isdir(got['path']):
        return dict(published=False, lines=[line for line in got['lines'] if got['path'] in line])
    try:
        weight = read_all_shards(got['path'])['model']['weight']
    except Exception as e:  # noqa: BLE001 - a published checkpoint that does not load
        return dict(published=True, error=f'{type(e).__name__}: {e}')
    return dict(published=True, diff=(weight - got['truth']).abs().max().item())


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory) -> dict:
    ranks = run_distributed(_rounds, 2, str(tmp_path_factory.mktemp('teardown')), timeout=400)
    # rank 1's log lines are not needed: rank 0 publishes, and logs what it does not
    return {name: _outcome(got) for name, got in ranks[0].items()}


def test_shutdown_distributed_first_publishes_the_write_whole(outcomes):
    got = {n: o for n, o in outcomes.items() if n.startswith('shutdown')}
    assert all(o == dict(published=True, diff=0.0) for o in got.values()), got


def test_a_destroyed_group_never_publishes_a_partial_write_nor_loses_one_silently(outcomes):
    got = {n: o for n, o in outcomes.items() if n.startswith('destroy')}
    print({n: o.get('diff', o.get('error', 'not published')) for n, o in got.items()})
    for name, outcome in got.items():
        if outcome['published']:
            assert outcome.get('diff') == 0.0, (name, outcome)
        else:
            assert outcome['lines'], (name, 'lost without a log line')
