"""Models that run their own steps, and mmfsdp's DDP options, as mmengine users expect them.

- FSDP1 leaves a child whose parameters are all frozen (an EMA copy) as it is,
  as mmengine's ``MMSeparateDistributedDataParallel`` does;
- FSDP1 trains such a model with an ``auto_wrap_policy`` whose class one child
  lacks (a generator block): each root gets its slice of the model's layout;
- FSDP1 meta init runs such a model's own ``init_weights`` and materialises a
  buffer it holds itself, as FSDP2 does;
- FSDP2 installs no parameter-usage probe on such a model (its forward never
  runs through the wrapper) and refuses ``accumulation='unsharded'``, which acts
  at that forward;
- ``mmfsdp.MMDistributedDataParallel`` takes every keyword mmengine's DDP
  wrapper passes on (``detect_anomalous_params`` and torch's), and maps
  ``broadcast_buffers`` to torch 2.13's ``forward_sync_buffers`` without its
  deprecation warning.

All multi-process checks share one 2-process group.
"""
import copy
import inspect
import warnings

import pytest
import torch
from mmengine.config import Config
from mmengine.model import MMDistributedDataParallel as MMEngineDDP
from mmengine.model import MMSeparateDistributedDataParallel
from mmengine.registry import MODELS
from torch import nn

from contract_models import IN_DIM, NOISE_DIM, ToyGAN
from harness import raised, run_distributed
from toy import ToyClassifier, runner_config

FSDP1 = 'mmfsdp.MMFullyShardedDataParallel'
FSDP2 = 'mmfsdp.MMFullyShard'
GAN_OPTIM = dict(constructor='PerChildOptimConstructor',
                 generator=dict(optimizer=dict(type='Adam', lr=1e-3)),
                 discriminator=dict(optimizer=dict(type='Adam', lr=1e-3)))


@MODELS.register_module(force=True)
class GANWithEMA(ToyGAN):
    """A GAN holding a frozen copy of its generator, as mmagic's EMA generators are held."""

    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor)
        self.ema = copy.deepcopy(self.generator).requires_grad_(False)


@MODELS.register_module(force=True)
class SelfInitGAN(ToyGAN):
    """A GAN whose own ``init_weights`` writes a child's bias and a buffer of its own."""

    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor)
        self.register_buffer('generation', torch.zeros(1))

    def init_weights(self) -> None:
        super().init_weights()
        with torch.no_grad():
            self.generator[0].bias.fill_(0.5)
            self.generation.fill_(3.0)


class GenBlock(nn.Module):
    """A block only the generator has."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.fc(x))


@MODELS.register_module(force=True)
class BlockGAN(ToyGAN):
    """A GAN whose generator holds a block class that its discriminator does not."""

    def __init__(self, data_preprocessor=None) -> None:
        super().__init__(data_preprocessor)
        self.generator = nn.Sequential(nn.Linear(NOISE_DIM, 16), GenBlock(),
                                       nn.Linear(16, IN_DIM))


def _config(name: str, root: str, model: str, wrapper: dict) -> Config:
    cfg = runner_config(name, f'{root}/{name}', batch_size=4, max_iters=2, wrapper=wrapper,
                        optim_wrapper=copy.deepcopy(GAN_OPTIM))
    cfg['model'] = dict(type=model)
    return Config(cfg)


def _full_state(model: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _frozen_child(root: str) -> tuple:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from mmfsdp import FSDPRunner
    runner = FSDPRunner.from_cfg(_config('ema-child', root, 'GANWithEMA', dict(type=FSDP1)))
    runner.train()
    model = runner.model.module
    return (isinstance(model.ema, FullyShardedDataParallel),
            all(isinstance(getattr(model, n), FullyShardedDataParallel)
                for n in ('generator', 'discriminator')),
            all(not p.requires_grad for p in model.ema.parameters()))


def _block_policy(root: str) -> tuple:
    from torch.distributed.fsdp import FullyShardedDataParallel

    from mmfsdp import FSDPRunner
    runner = FSDPRunner.from_cfg(_config('block-policy', root, 'BlockGAN', dict(
        type=FSDP1, auto_wrap_policy=dict(type='module_types', module_cls=['GenBlock']))))
    runner.train()
    units = FullyShardedDataParallel.fsdp_modules(runner.model.module)
    return sorted(type(u.module).__name__ for u in units), runner.iter


def _meta_init(root: str, name: str, wrapper: str) -> dict:
    from mmfsdp import FSDPRunner
    runner = FSDPRunner.from_cfg(_config(f'meta-{name}', root, 'SelfInitGAN',
                                         dict(type=wrapper, init_device='meta')))
    model = runner.model.module
    state = _full_state(runner.model)
    return dict(bias=state['generator.0.bias'].tolist(), generation=model.generation.tolist(),
                on_meta=[n for n, t in (*model.named_parameters(), *model.named_buffers())
                         if t.is_meta])


def _probe_hooks_left(root: str) -> list:
    from mmfsdp import FSDPRunner
    runner = FSDPRunner.from_cfg(_config('probe', root, 'ToyGAN', dict(type=FSDP2)))
    runner.train()
    return [n for n, m in runner.model.module.named_modules()
            if isinstance(m, nn.Linear) and m._forward_hooks]


def _record(out: dict, key: str, fn) -> None:
    """``out[key] = fn()``; a failing check fails its own test, not its neighbours'."""
    try:
        out[key] = fn()
    except Exception as e:  # noqa: BLE001
        out[key] = ('raised', f'{type(e).__name__}: {e}')


def _own_steps(root: str, out: dict) -> None:
    from mmfsdp import FSDPRunner
    _record(out, 'frozen child', lambda: _frozen_child(root))
    _record(out, 'block policy', lambda: _block_policy(root))
    for name, wrapper in (('fsdp1', FSDP1), ('fsdp2', FSDP2)):
        _record(out, f'meta {name}', lambda n=name, w=wrapper: _meta_init(root, n, w))
    _record(out, 'probe hooks left', lambda: _probe_hooks_left(root))
    out['unsharded refused'] = raised(lambda: FSDPRunner.from_cfg(_config(
        'unsharded', root, 'ToyGAN', dict(type=FSDP2, accumulation='unsharded'))).train())


def _ddp(**options) -> tuple:
    from mmfsdp import MMDistributedDataParallel
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        ddp = MMDistributedDataParallel(ToyClassifier(), **options)
    return ddp, [str(w.message) for w in caught if 'broadcast_buffers' in str(w.message)]


def _buffer_sync(broadcast_buffers: bool) -> tuple:
    ddp, warned = _ddp(broadcast_buffers=broadcast_buffers)
    return ddp.forward_sync_buffers, warned


def _other_keywords() -> tuple:
    ddp, _ = _ddp(detect_anomalous_params=True, bucket_cap_mb=1, init_sync=True)
    return ddp.detect_anomalous_params, ddp.bucket_bytes_cap


def _ddp_options(out: dict) -> None:
    torch.distributed.barrier()  # every rank is past the runner checks above
    for value in (False, True):
        _record(out, f'broadcast_buffers={value}', lambda v=value: _buffer_sync(v))
    _record(out, 'other keywords', _other_keywords)
    stock = MMSeparateDistributedDataParallel(GANWithEMA()).module
    out['stock frozen child'] = (isinstance(stock.ema, MMEngineDDP),
                                 isinstance(stock.generator, MMEngineDDP))


def _everything(root: str) -> dict:
    out: dict = {}
    _own_steps(root, out)  # FSDPRunner starts the group the DDP checks use
    _ddp_options(out)
    return out


@pytest.fixture(scope='module')
def ranks(tmp_path_factory) -> list:
    return run_distributed(_everything, 2, str(tmp_path_factory.mktemp('own-steps')), timeout=480)


def test_stock_separate_ddp_leaves_a_frozen_child_unwrapped(ranks):
    for rank in ranks:
        assert rank['stock frozen child'] == (False, True)


def test_fsdp1_leaves_a_frozen_child_of_a_model_with_own_steps_unwrapped(ranks):
    for rank in ranks:
        assert rank['frozen child'][0] != 'raised', rank['frozen child']
        ema_wrapped, trained_wrapped, still_frozen = rank['frozen child']
        assert not ema_wrapped and trained_wrapped and still_frozen


def test_fsdp1_gives_each_root_its_slice_of_a_policy_one_child_does_not_match(ranks):
    for rank in ranks:
        # the discriminator has no GenBlock: it is a root of one unit, not refused
        assert rank['block policy'] == (['GenBlock', 'Sequential', 'Sequential'], 2)


@pytest.mark.parametrize('wrapper', ['fsdp1', 'fsdp2'])
def test_meta_init_runs_the_own_init_weights_of_a_model_with_own_steps(ranks, wrapper):
    for rank in ranks:
        got = rank[f'meta {wrapper}']
        assert isinstance(got, dict), got
        assert got['on_meta'] == []
        assert got['bias'] == [0.5] * 16 and got['generation'] == [3.0]


def test_fsdp2_leaves_no_usage_probe_on_a_model_with_own_steps(ranks):
    assert [r['probe hooks left'] for r in ranks] == [[], []]


def test_fsdp2_refuses_unsharded_accumulation_for_a_model_with_own_steps(ranks):
    for rank in ranks:
        error, message = rank['unsharded refused']
        assert error == 'ValueError', message
        assert "accumulation='unsharded'" in message and "accumulation='sharded'" in message


def test_stock_ddp_wrapper_passes_other_keywords_on():
    parameters = inspect.signature(MMEngineDDP.__init__).parameters
    assert 'detect_anomalous_params' in parameters
    assert any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def test_ddp_takes_mmengines_and_torchs_keywords(ranks):
    for rank in ranks:
        assert rank['other keywords'] == (True, 1 << 20)


@pytest.mark.parametrize('value', [False, True])
def test_ddp_broadcast_buffers_becomes_forward_sync_buffers_without_a_warning(ranks, value):
    for rank in ranks:
        assert rank[f'broadcast_buffers={value}'] == (value, [])
