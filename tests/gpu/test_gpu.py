"""The GPU tier (``pytest -m gpu``): FSDP1, FSDP2 and DDP on CUDA with NCCL.

Deselected by default (``pyproject.toml``); skipped where no CUDA GPU is
visible. The world size is the number of visible GPUs (1 is enough). Three
process groups:

- **NCCL** (started here with ``init_process_group('nccl')``, as a launcher
  script would; the runner must still pick ``cuda:LOCAL_RANK``): fp32 runs of
  each wrapper compared with one process on one GPU; bf16 runs of each wrapper
  that save full and sharded checkpoints halfway and resume from them; FSDP2
  with meta init.
- **CPU offload** (started by ``FSDPRunner``, which must ask for
  ``cpu:gloo,cuda:nccl``): FSDP2 offload with fp16 AMP and gradient clipping,
  FSDP1 ``cpu_offload`` with bf16; full checkpoints gathered to rank 0's CPU;
  resume; a full ``load_from`` into a BatchNorm model under FSDP1 offload
  (parameters on the CPU, running statistics on the GPU).
- **Demo configs**: ``tools/train.py`` under torchrun for a few iterations.

Run on a GPU machine: ``python -m pytest -m gpu -q``.
"""
import copy
import math
import os
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config
from mmengine.registry import MODELS
from mmengine.runner import Runner

from harness import DIST_CFG, REPO, run_distributed
from toy import IN_DIM, ToyClassifier, runner_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason='no CUDA GPU visible: the GPU tier runs FSDP/DDP on NCCL'),
]

FSDP1, FSDP2, DDP = ('mmfsdp.MMFullyShardedDataParallel', 'mmfsdp.MMFullyShard',
                     'mmfsdp.MMDistributedDataParallel')
BLOCKS = dict(type='transformer', layer_cls=['ToyBlock'])
ADAMW = dict(optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.0))
BF16_FSDP1 = dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32')
BF16_FSDP2 = dict(param_dtype='bf16', reduce_dtype='fp32')
#: name -> (model_wrapper_cfg, optim_wrapper): fp32, compared with one process.
FP32 = {
    'fsdp1': (dict(type=FSDP1, auto_wrap_policy=BLOCKS), ADAMW),
    'fsdp2': (dict(type=FSDP2, auto_wrap_policy=BLOCKS), ADAMW),
    'ddp': (dict(type=DDP), ADAMW),
}
#: bf16 mixed precision: wrapper policies for FSDP, bf16 autocast for DDP.
BF16 = {
    'fsdp1': (dict(type=FSDP1, auto_wrap_policy=BLOCKS, mixed_precision=BF16_FSDP1), ADAMW),
    'fsdp2': (dict(type=FSDP2, auto_wrap_policy=BLOCKS, mixed_precision=BF16_FSDP2), ADAMW),
    'ddp': (dict(type=DDP), dict(ADAMW, type='mmfsdp.AmpOptimWrapper', dtype='bfloat16')),
}
META = (dict(type=FSDP2, auto_wrap_policy=BLOCKS, mixed_precision=BF16_FSDP2,
             init_device='meta'), ADAMW)
AMP_CLIP = dict(type='mmfsdp.AmpOptimWrapper', dtype='float16',
                optimizer=dict(type='AdamW', lr=1e-2), clip_grad=dict(max_norm=0.05))
OFFLOAD = {
    'fsdp2': (dict(type=FSDP2, auto_wrap_policy=BLOCKS, offload=dict(cpu_offload=True)),
              AMP_CLIP),
    'fsdp1': (dict(type=FSDP1, auto_wrap_policy=BLOCKS, mixed_precision=BF16_FSDP1,
                   cpu_offload=True), dict(ADAMW, clip_grad=dict(max_norm=0.05))),
}
#: FSDP1 offload of a model with BatchNorm: parameters on the CPU, running statistics
#: (persistent buffers) on the GPU, which torch's full-state load refuses as two devices.
OFFLOAD_BN = dict(type=FSDP1, auto_wrap_policy=BLOCKS, cpu_offload=True)
BN_MODEL = dict(type='ToyBatchNormClassifier')
PER_RANK_BATCH, HALF, TOTAL = 4, 3, 6
TYPES = ('full', 'sharded')
#: fp32 on GPU: cuBLAS may pick other kernels for other batch shapes.
ONE_PROCESS_TOL = 5e-5
#: A resumed run repeats the same kernels on the same data.
RESUME_TOL = 1e-5
#: Long enough for the loss to fall well beyond the noise of single batches.
LEARN_ITERS = 30


@MODELS.register_module()
class ToyBatchNormClassifier(ToyClassifier):
    """``ToyClassifier`` whose inputs pass a ``BatchNorm1d`` first."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.input_norm = torch.nn.BatchNorm1d(IN_DIM)

    def forward(self, inputs, data_samples=None, mode: str = 'tensor'):
        return super().forward(self.input_norm(inputs), data_samples, mode)


def _history(runner, key: str) -> list:
    if not runner.message_hub.log_scalars.get(key):
        return []
    return [float(v) for v in runner.message_hub.get_scalar(key).data[0]]


def _train(root: str, name: str, wrapper: dict, optim: dict, *, checkpoint: str = None,
           resume_from: str = None, max_iters: int = TOTAL, model: dict = None) -> dict:
    """Train one toy run; rank 0 gets the full final state (on the CPU), others ``{}``."""
    from mmfsdp import FSDPRunner
    from mmfsdp.checkpoint.state import gather_full_state
    cfg = runner_config(name, f'{root}/{name}', wrapper=copy.deepcopy(wrapper),
                        optim_wrapper=copy.deepcopy(optim), batch_size=PER_RANK_BATCH,
                        max_iters=max_iters)
    if checkpoint is not None:
        cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=HALF,
                                                  by_epoch=False, state_dict_type=checkpoint)
    if resume_from is not None:
        cfg.update(load_from=resume_from, resume=True)
    if model is not None:
        cfg['model'] = model
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.train()
    params = list(runner.model.parameters())
    model_state, optimizer = gather_full_state(runner.model, runner.optim_wrapper)
    return dict(
        state={k: v.detach().float().clone() for k, v in model_state.items()},
        state_devices=sorted({v.device.type for v in model_state.values()}),
        optimizer_devices=sorted({t.device.type for s in (optimizer or {}).get('state', {})
                                  .values() for t in s.values() if isinstance(t, torch.Tensor)}),
        loss=_history(runner, 'train/loss'), grad_norm=_history(runner, 'train/grad_norm'),
        param_devices=sorted({p.device.type for p in params}),
        grad_devices=sorted({p.grad.device.type for p in params if p.grad is not None}),
        master_dtypes=sorted({str(p.dtype) for p in params}),
        scaler=type(getattr(runner.optim_wrapper, 'loss_scaler', None)).__name__,
        current_device=torch.cuda.current_device())


def _ckpt(root: str, name: str) -> str:
    return os.path.join(root, name, f'iter_{HALF}.pth')


def _nccl_group(root: str) -> dict:
    """The NCCL runs, in a group this function starts (not the runner)."""
    import torch.distributed as dist

    import mmfsdp  # noqa: F401
    dist.init_process_group('nccl', timeout=__import__('datetime').timedelta(seconds=120))
    out = dict(backend=dist.get_backend(), local_rank=int(os.environ['LOCAL_RANK']))
    for name, (wrapper, optim) in FP32.items():
        out[f'fp32/{name}'] = _train(root, f'fp32-{name}', wrapper, optim)
    for name, (wrapper, optim) in BF16.items():
        for kind in TYPES:
            run = f'bf16-{name}-{kind}'
            out[f'bf16/{name}/{kind}'] = _train(root, run, wrapper, optim, checkpoint=kind)
            out[f'bf16/{name}/{kind}/resumed'] = _train(
                root, f'{run}-resumed', wrapper, optim, resume_from=_ckpt(root, run))
    out['meta/fsdp2'] = _train(root, 'meta-fsdp2', *META, max_iters=LEARN_ITERS)
    return out


def _offload_group(root: str) -> dict:
    """The CPU-offload runs; the first runner starts the process group."""
    import torch.distributed as dist

    import mmfsdp  # noqa: F401
    out = {}
    for name, (wrapper, optim) in OFFLOAD.items():
        for kind in TYPES:
            run = f'offload-{name}-{kind}'
            out[f'{name}/{kind}'] = _train(root, run, wrapper, optim, checkpoint=kind)
            out.setdefault('backend', dist.get_backend())
            out[f'{name}/{kind}/resumed'] = _train(root, f'{run}-resumed', wrapper, optim,
                                                   resume_from=_ckpt(root, run))
    _train(root, 'offload-bn', OFFLOAD_BN, ADAMW, checkpoint='full', model=BN_MODEL)
    out['bn/loaded'] = _loaded_from(root, 'offload-bn-loaded', _ckpt(root, 'offload-bn'))
    return out


def _loaded_from(root: str, name: str, checkpoint: str) -> dict:
    """The full state of the BatchNorm model under FSDP1 offload right after ``load_from``."""
    from mmfsdp import FSDPRunner
    from mmfsdp.checkpoint.state import gather_full_state
    cfg = runner_config(name, f'{root}/{name}', wrapper=copy.deepcopy(OFFLOAD_BN),
                        optim_wrapper=copy.deepcopy(ADAMW), batch_size=PER_RANK_BATCH)
    cfg.update(model=BN_MODEL, load_from=checkpoint)
    runner = FSDPRunner.from_cfg(Config(cfg))
    runner.load_or_resume()  # wraps the model, then loads load_from (as train() does)
    buffers = sorted({b.device.type for b in runner.model.buffers() if b.dim() > 0})
    state = gather_full_state(runner.model, None)[0]
    return dict(state={k: v.detach().float().clone() for k, v in state.items()},
                buffer_devices=buffers,
                expected=torch.load(checkpoint)['state_dict'] if state else {})


@pytest.fixture(scope='module')
def world_size() -> int:
    return torch.cuda.device_count()


@pytest.fixture(scope='module')
def nccl(tmp_path_factory, world_size) -> list:
    return run_distributed(_nccl_group, world_size, str(tmp_path_factory.mktemp('nccl')),
                           timeout=900)


@pytest.fixture(scope='module')
def offload(tmp_path_factory, world_size) -> list:
    return run_distributed(_offload_group, world_size, str(tmp_path_factory.mktemp('offload')),
                           timeout=900)


def _max_abs_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _finite(loss: list) -> bool:
    return len(loss) == TOTAL and all(math.isfinite(v) for v in loss)


def _learned(loss: list) -> bool:
    """The mean loss of the last five iterations is well below that of the first five."""
    return all(math.isfinite(v) for v in loss) and sum(loss[-5:]) < 0.8 * sum(loss[:5])


def test_each_rank_trains_on_its_own_gpu_in_a_group_it_did_not_start(nccl):
    for rank in nccl:
        assert rank['backend'] == 'nccl'
        for result in (v for v in rank.values() if isinstance(v, dict)):
            assert result['current_device'] == rank['local_rank']
            assert result['param_devices'] == ['cuda']


@pytest.mark.parametrize('name', list(FP32))
def test_fp32_training_equals_one_process(nccl, world_size, tmp_path, name):
    wrapper, optim = FP32[name]
    cfg = runner_config(f'reference-{name}', str(tmp_path), launcher='none',
                        batch_size=PER_RANK_BATCH * world_size, max_iters=TOTAL,
                        optim_wrapper=copy.deepcopy(optim))
    runner = Runner.from_cfg(Config(cfg))
    runner.train()
    reference = {k: v.detach().float().cpu() for k, v in runner.model.state_dict().items()}
    diff = _max_abs_diff(nccl[0][f'fp32/{name}']['state'], reference)
    print(f'{name}: max abs diff to one process {diff:.2e}')
    assert diff <= ONE_PROCESS_TOL


@pytest.mark.parametrize('name', list(BF16))
@pytest.mark.parametrize('kind', TYPES)
def test_bf16_run_resumes_exactly_from_its_checkpoint(nccl, name, kind):
    straight, resumed = nccl[0][f'bf16/{name}/{kind}'], nccl[0][f'bf16/{name}/{kind}/resumed']
    assert _finite(straight['loss'])
    assert straight['master_dtypes'] == ['torch.float32']  # fp32 master weights, bf16 compute
    diff = _max_abs_diff(resumed['state'], straight['state'])
    print(f'bf16 {name} {kind}: resumed vs uninterrupted {diff:.2e}')
    assert diff <= RESUME_TOL


def test_fsdp2_meta_init_trains_on_gpu(nccl):
    result = nccl[0]['meta/fsdp2']
    assert _learned(result['loss']), result['loss']
    assert result['param_devices'] == ['cuda']


def test_offload_group_has_a_cpu_backend_next_to_nccl(offload):
    assert {rank['backend'] for rank in offload} == {'cpu:gloo,cuda:nccl'}


@pytest.mark.parametrize('name', list(OFFLOAD))
def test_offloaded_training_clips_and_keeps_state_on_the_cpu(offload, name):
    for kind in TYPES:
        result = offload[0][f'{name}/{kind}']
        assert _finite(result['loss']), result['loss']
        assert result['param_devices'] == ['cpu'] and result['grad_devices'] in ([], ['cpu'])
        # fp16 AMP: the first steps may overflow at the initial scale (inf norm, step
        # skipped, scale lowered); the rest are finite and above max_norm.
        norms = result['grad_norm']
        finite = [n for n in norms if math.isfinite(n)]
        assert len(norms) == TOTAL and len(finite) >= TOTAL - 2, norms
        assert min(finite) > 0.05, norms  # clipping was active


@pytest.mark.parametrize('name', list(OFFLOAD))
def test_full_state_of_an_offloaded_model_gathers_to_rank_0_cpu(offload, name):
    result = offload[0][f'{name}/full']
    assert result['state_devices'] == ['cpu'] and result['optimizer_devices'] == ['cpu']
    for rank in offload[1:]:  # rank0_only: the other ranks hold nothing
        assert rank[f'{name}/full']['state'] == {}


@pytest.mark.parametrize('name', list(OFFLOAD))
@pytest.mark.parametrize('kind', TYPES)
def test_offloaded_run_resumes_exactly(offload, request, name, kind):
    if name == 'fsdp1':
        # Measured on an H100 (torch 2.11, one rank): with cpu_offload, state loaded into an
        # FSDP1 model before its first forward leaves the resumed run off the uninterrupted
        # one (max abs diff 6.6e-2, full and sharded alike). Reproduced with torch alone
        # (FSDP1 + set_model/optimizer_state_dict); exact without offload, and exact when
        # one forward runs before loading. Not measured at more than one rank.
        request.applymarker(pytest.mark.xfail(
            strict=True, reason='torch FSDP1 cpu_offload: loading before the first forward '
                                'breaks exact resume'))
    straight, resumed = offload[0][f'{name}/{kind}'], offload[0][f'{name}/{kind}/resumed']
    diff = _max_abs_diff(resumed['state'], straight['state'])
    print(f'offload {name} {kind}: resumed vs uninterrupted {diff:.2e}')
    assert diff <= RESUME_TOL, (straight['loss'], resumed['loss'])


def test_full_load_from_fills_an_offloaded_batchnorm_model(offload):
    """FSDP1 cpu_offload + BatchNorm: load_from a full checkpoint loads every entry, the
    running statistics included, and leaves the buffers on the GPU."""
    loaded = offload[0]['bn/loaded']
    assert 'input_norm.running_mean' in loaded['expected']
    assert _max_abs_diff(loaded['state'], loaded['expected']) == 0
    assert loaded['expected']['input_norm.num_batches_tracked'] == HALF
    assert all(rank['bn/loaded']['buffer_devices'] == ['cuda'] for rank in offload)


@pytest.mark.parametrize('config', ['gpt-nano_fsdp_2xcpu.py', 'gpt-nano_fsdp2_2xcpu.py',
                                    'gpt-nano_ddp_2xcpu.py'])
def test_demo_config_trains_a_few_iterations(tmp_path, world_size, config):
    work_dir = tmp_path / 'work'
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone',
           f'--nproc-per-node={world_size}', os.path.join(REPO, 'tools', 'train.py'),
           os.path.join(REPO, 'configs', config), '--launcher', 'pytorch',
           '--work-dir', str(work_dir), '--cfg-options', 'train_cfg.max_iters=6',
           'train_cfg.val_interval=6', 'default_hooks.logger.interval=2',
           f"env_cfg.dist_cfg.timeout={DIST_CFG['timeout']}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    log = proc.stdout + proc.stderr
    assert 'Iter(train) [6/6]' in log and 'Iter(val)' in log, log[-3000:]
    assert (work_dir / 'iter_6.pth').exists()
