"""The sharding plan checked against real runs: exact bytes per rank, the log, the command."""
import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config
from torch.distributed.tensor import DTensor

from harness import REPO, run_distributed
from mmfsdp.plan import Padding, plan_for
from mmfsdp.wrappers import MMDistributedDataParallel, MMFullyShard, MMFullyShardedDataParallel
from toy import meta_toy, runner_config

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke

FSDP = 'mmfsdp.MMFullyShardedDataParallel'
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
ADAMW = dict(type='AdamW', lr=1e-2)
#: name -> (wrapper class, model_wrapper_cfg)
WRAPPERS = {
    'fsdp/full_shard': (MMFullyShardedDataParallel, dict(type=FSDP, auto_wrap_policy=BLOCKS)),
    'fsdp/shard_grad_op': (MMFullyShardedDataParallel, dict(
        type=FSDP, auto_wrap_policy=BLOCKS, sharding_strategy='SHARD_GRAD_OP')),
    'fsdp2': (MMFullyShard, dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=BLOCKS)),
    'ddp': (MMDistributedDataParallel, dict(type='mmfsdp.MMDistributedDataParallel')),
}



def _held_bytes(runner) -> dict:
    """Bytes of parameters, gradients and optimizer state this rank holds."""
    model, optimizer = runner.model, runner.optim_wrapper.optimizer
    with runner.optim_wrapper.optim_context(model):
        data = model.module.data_preprocessor(next(iter(runner.train_dataloader)), True)
        loss = model(**data, mode='loss')['loss']
    loss.backward()

    def size(t: torch.Tensor) -> int:  # a DTensor's numel is global: count the local shard
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    return dict(
        params=sum(size(p) for p in model.parameters()),
        grads=sum(size(p.grad) for p in model.parameters() if p.grad is not None),
        optimizer=sum(size(t) for state in optimizer.state.values() for t in state.values()
                      if torch.is_tensor(t) and t.dim() > 0))


def _truth(root: str) -> dict:
    from mmfsdp import FSDPRunner
    out = {}
    for name, (_, wrapper) in WRAPPERS.items():
        cfg = runner_config(name.replace('/', '-'), f'{root}/{name}', wrapper=wrapper,
                            batch_size=4, max_iters=1, optim_wrapper=dict(optimizer=ADAMW))
        cfg['log_level'] = 'INFO'
        runner = FSDPRunner.from_cfg(Config(cfg))
        runner.train()
        out[name] = _held_bytes(runner)
        logs = glob.glob(f'{root}/{name}/*/*.log')
        out[name]['log'] = open(logs[0]).read() if logs else ''
    return out


@pytest.fixture(scope='module')
def held(tmp_path_factory) -> list:
    return run_distributed(_truth, 2, str(tmp_path_factory.mktemp('plan')))


@pytest.mark.parametrize('name', list(WRAPPERS))
def test_plan_equals_bytes_held_after_a_step_up_to_padding(held, name):
    cls, wrapper = WRAPPERS[name]
    plan = plan_for(cls, wrapper, meta_toy(), 2, ADAMW)
    planned = dict(params=sum(u.param_bytes for u in plan.units),
                   grads=sum(u.grad_bytes for u in plan.units),
                   optimizer=sum(u.optimizer_bytes for u in plan.units))
    # padding: at most (shard size - 1) elements per flat unit, or rows per parameter (dim 0)
    extra = plan.spec.shard_size - 1
    if plan.spec.padding is Padding.DIM0:
        slack = sum(extra * p.numel() // p.shape[0] for p in meta_toy().parameters()) * 4
    else:
        slack = len(plan.units) * extra * 4
    for rank in held:
        for kind in ('params', 'grads', 'optimizer'):
            per_state = 2 if kind == 'optimizer' else 1
            print(f'{name} {kind}: plan {planned[kind]} B, held {rank[name][kind]} B')
            assert 0 <= planned[kind] - rank[name][kind] <= slack * per_state
    assert sum(planned.values()) == plan.model_state_bytes_per_rank


def test_rank_0_logs_the_plan_when_the_wrapper_is_built(held):
    log = held[0]['fsdp/full_shard']['log']
    assert 'Sharding plan:' in log and 'mmfsdp.MMFullyShardedDataParallel FULL_SHARD' in log
    assert 'blocks.0' in log and 'ToyBlock' in log
    assert 'left in the root unit: embed, norm, head' in log


@pytest.mark.parametrize('config', sorted(
    f for f in os.listdir(os.path.join(REPO, 'configs')) if f.endswith('.py')))
def test_dry_run_prints_the_plan_of_every_example_config(config, capsys, monkeypatch):
    # The CLI's main in this process (no interpreter start-up per config); the tests
    # below run it as `python -m mmfsdp.plan`.
    from mmfsdp.plan.__main__ import main
    monkeypatch.chdir(REPO)
    # a fixed replicate x shard mesh fits one world size only
    sizes = ['4'] if 'hsdp_2x2' in config else ['1', '8', '64']
    capsys.readouterr()
    main([f'configs/{config}', '--world-size', *sizes, '--format', 'json'])
    plans = json.loads(capsys.readouterr().out)
    assert [p['world_size'] for p in plans] == [int(n) for n in sizes]
    for plan in plans:
        assert {'model_state_bytes_per_rank', 'peak_bytes_per_rank_estimate', 'units'} <= set(plan)
        assert plan['peak_bytes_per_rank_estimate'] >= plan['model_state_bytes_per_rank']


def test_dry_run_of_a_billion_parameters_takes_seconds():
    # --no-trace: the plan of the model states; the step trace is tests/test_plan_peak.py's
    out = subprocess.run([sys.executable, '-m', 'mmfsdp.plan', 'configs/gpt-nano_fsdp_2xcpu.py',
                          '--world-size', '64', '--format', 'json', '--no-trace', '--cfg-options',
                          'model.n_layer=24', 'model.n_embd=1792', 'model.n_head=28'],
                         cwd=REPO, check=True, capture_output=True, text=True, timeout=60).stdout
    plan = json.loads(out)[0]
    assert plan['numel'] > 0.9e9
    assert plan['model_state_bytes_per_rank'] < 1.05 * 16 * plan['numel'] / 64


def test_dry_run_piped_into_head_ends_quietly():
    # 64 plans of JSON fill the pipe, so the reader's early close breaks a pending write.
    proc = subprocess.Popen([sys.executable, '-m', 'mmfsdp.plan', 'configs/gpt-nano_fsdp_2xcpu.py',
                             '--world-size', *map(str, range(1, 65)), '--format', 'json'],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == '[\n'
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1
    assert err == ''
