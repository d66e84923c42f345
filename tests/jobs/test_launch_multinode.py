"""Two nodes simulated on one machine: two torchrun agents, 2 processes each, hybrid sharding.

The agents rendezvous on 127.0.0.1 as ``--nnodes 2 --node_rank 0`` and ``1``
and run ``tools/train.py`` with ``configs/gpt-nano_hsdp_2x2cpu.py`` (FSDP2,
``mesh=dict(replicate=2, shard=2)``), exactly as two machines would. A probe
hook, added through the config, records on every rank which ranks its
parameters are sharded and replicated over and its local shards. The test
checks that shard groups stay inside a node and replica groups span the
nodes, that replicas hold equal shards, and that the trained weights equal
those of mmengine's stock ``Runner`` training the same global batch on one
process (max abs diff 1e-7 here).
"""
import sys
from pathlib import Path

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner

from harness import REPO, free_port, job_env
from job import Job

HSDP_CONFIG = REPO / 'configs' / 'gpt-nano_hsdp_2x2cpu.py'
NODES, PROCS_PER_NODE, BATCH_PER_RANK, ITERS = 2, 2, 4, 4
TIMEOUT_S = 300
TOL = 2e-5

PROBE = '''
"""Records each rank's device mesh groups and local shards after the last step."""
import os

import torch
import torch.distributed as dist
from mmengine.hooks import Hook
from mmengine.registry import HOOKS
from torch.distributed.tensor import DTensor


@HOOKS.register_module()
class HsdpProbeHook(Hook):

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        # After the last step: every group is sharded again (a forward without
        # backward, as in validation, would leave the root's parameters gathered).
        if runner.iter + 1 < runner.max_iters:
            return
        params = dict(runner.model.module.named_parameters())
        mesh = next(p.device_mesh for p in params.values() if isinstance(p, DTensor))
        torch.save(dict(
            node=int(os.environ['GROUP_RANK']), local_rank=int(os.environ['LOCAL_RANK']),
            groups={dim: dist.get_process_group_ranks(mesh.get_group(dim))
                    for dim in mesh.mesh_dim_names},
            placements={n: [(('shard', pl.dim) if pl.is_shard() else ('replicate',)
                             if pl.is_replicate() else (str(pl),)) for pl in p.placements]
                        if isinstance(p, DTensor) else type(p).__name__
                        for n, p in params.items()},
            shards={n: p.to_local().detach().clone() for n, p in params.items()
                    if isinstance(p, DTensor)},
        ), os.path.join(self.out_dir, f'rank{dist.get_rank()}.pt'))
'''

#: A few steps and no validation (training is what is compared). SGD, not the
#: config's AdamW: Adam normalises each gradient's scale away, so a gradient
#: averaged over the wrong group of ranks would still train the same weights.
SHORT_SCHEDULE = dict(
    train_cfg=dict(max_iters=ITERS, val_interval=100),
    default_hooks=dict(logger=dict(interval=1)),
    optim_wrapper=dict(optimizer=dict(_delete_=True, type='SGD', lr=0.5, momentum=0.9)),
)
NO_VAL = dict(val_dataloader=None, val_cfg=None, val_evaluator=None)


def _run_agents(cmds, env, timeout):
    with Job(cmds, env, str(REPO)) as job:
        finished = job.wait(timeout)
        outputs = [job.stdout(i) for i in range(len(cmds))]
    if not finished:
        pytest.fail(f'torchrun agents still running after {timeout} s (every process killed):\n'
                    + '\n'.join(out[-6000:] for out in outputs))
    for node, (code, out) in enumerate(zip(job.returncodes, outputs)):
        assert code == 0, f'node {node} exited {code}:\n{out[-6000:]}'
    assert not job.left_behind, f'the agents left {len(job.left_behind)} processes running'
    return outputs


def _stock_runner_state(work_dir: Path) -> dict:
    """mmengine's Runner, one process, the global batch of all ranks."""
    cfg = Config.fromfile(HSDP_CONFIG)
    for key in ('runner_type', 'model_wrapper_cfg'):
        cfg.pop(key)
    cfg.merge_from_dict(SHORT_SCHEDULE)
    cfg.update(NO_VAL)
    cfg.merge_from_dict(dict(
        work_dir=str(work_dir), launcher='none', experiment_name='hsdp_reference',
        train_dataloader=dict(batch_size=NODES * PROCS_PER_NODE * BATCH_PER_RANK,
                              sampler=dict(seed=0)),
        default_hooks=dict(checkpoint=None), log_level='WARNING'))
    runner = Runner.from_cfg(cfg)
    runner.train()
    return {k: v.detach().clone() for k, v in runner.model.state_dict().items()}


def test_two_torchrun_nodes_shard_inside_a_node_and_match_one_process(tmp_path):
    (tmp_path / 'hsdp_probe.py').write_text(PROBE)
    probe_dir = tmp_path / 'probe'
    probe_dir.mkdir()
    work_dir = tmp_path / 'work'
    config = tmp_path / 'hsdp_probe_config.py'
    config.write_text(
        f'_base_ = [{str(HSDP_CONFIG)!r}]\n'
        "custom_imports = dict(imports=['hsdp_probe'], allow_failed_imports=False)\n"
        f'custom_hooks = [dict(type="HsdpProbeHook", out_dir={str(probe_dir)!r})]\n'
        f'train_dataloader = dict(batch_size={BATCH_PER_RANK}, sampler=dict(seed=0))\n'
        f'train_cfg = {SHORT_SCHEDULE["train_cfg"]!r}\n'
        f'default_hooks = {SHORT_SCHEDULE["default_hooks"]!r}\n'
        f'optim_wrapper = {SHORT_SCHEDULE["optim_wrapper"]!r}\n'
        + ''.join(f'{key} = None\n' for key in NO_VAL))
    env = job_env(tmp_path, REPO)
    port = free_port()
    cmds = [[sys.executable, '-m', 'torch.distributed.run', '--nnodes', str(NODES),
             '--node_rank', str(node), '--nproc-per-node', str(PROCS_PER_NODE),
             '--master_addr', '127.0.0.1', '--master_port', str(port),
             'tools/train.py', str(config), '--launcher', 'pytorch',
             '--work-dir', str(work_dir)] for node in range(NODES)]
    _run_agents(cmds, env, TIMEOUT_S)

    world = NODES * PROCS_PER_NODE
    probes = [torch.load(probe_dir / f'rank{r}.pt') for r in range(world)]
    for rank, probe in enumerate(probes):
        assert probe['node'] == rank // PROCS_PER_NODE  # torchrun lays ranks out node by node
        shard_nodes = {probes[r]['node'] for r in probe['groups']['shard']}
        replica_nodes = {probes[r]['node'] for r in probe['groups']['replicate']}
        assert shard_nodes == {probe['node']}, 'a shard group must stay inside one node'
        assert len(probe['groups']['shard']) == PROCS_PER_NODE
        assert replica_nodes == set(range(NODES)), 'replicas must span the nodes'
        assert all(pl == [('replicate',), ('shard', 0)] for pl in probe['placements'].values()), (
            probe['placements'])
    # Replicas (same local rank, other node) hold the same shards; the two
    # ranks of a node hold different halves.
    for local in range(PROCS_PER_NODE):
        a, b = probes[local], probes[PROCS_PER_NODE + local]
        for name, shard in a['shards'].items():
            assert torch.equal(shard, b['shards'][name]), name
    assert not torch.equal(probes[0]['shards']['wte.weight'], probes[1]['shards']['wte.weight'])

    state = torch.load(work_dir / f'iter_{ITERS}.pth')['state_dict']
    reference = _stock_runner_state(tmp_path / 'reference')
    assert sorted(state) == sorted(reference)
    diff = max((state[k] - reference[k]).abs().max().item() for k in reference)
    print(f'HSDP 2 nodes x 2 vs stock Runner on 1 process: max abs diff {diff:.2e}')
    assert diff <= TOL
