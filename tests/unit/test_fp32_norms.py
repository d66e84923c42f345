"""``mixed_precision.fp32_modules``: norms compute in fp32 under bf16 mixed precision.

One 2-process gloo group runs every distributed check (starting interpreters is
the cost): the dtypes each module sees under FSDP2 and FSDP1, a small ResNet
trained under FSDP2, FSDP1 (with and without a wrap policy), and the #156784
configurations. The one-process reference is built here from plain torch, not
from mmfsdp: parameters cast to bf16 per use, batch norms in fp32 with their
input cast up and their output cast back, one replica of the buffers per rank.
The option's resolution, errors and plan are single-process tests.
"""
import copy
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm

from harness import max_abs_diff, raised, run_distributed
from mmfsdp import MMFullyShard, MMFullyShardedDataParallel
from mmfsdp.plan.memory import make_plan
from mmfsdp.wrappers import FSDPConfig, FullyShardConfig

WORLD_SIZE = 2
PER_RANK_BATCH = 4
STEPS = 4
LR = 0.1
BF16 = dict(param_dtype='bf16', reduce_dtype='fp32')
BLOCKS = dict(type='transformer', layer_cls=['Block'])


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the identity."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    """Stem (conv + BN, in the root unit), two blocks, global pooling, a linear head."""

    def __init__(self, channels: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(x.mean((2, 3)))


class GroupNormNet(nn.Module):
    """Conv + GroupNorm + LayerNorm + linear: norms a user adds to ``fp32_modules``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.gn(self.conv(x)).mean((2, 3))))


def _model(seed: int = 0) -> TinyResNet:
    torch.manual_seed(seed)
    model = TinyResNet()
    for m in model.modules():  # BN affine parameters away from 1 / 0, so they matter
        if isinstance(m, _BatchNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model


def _batch(step: int, rank: int):
    """Rank ``rank``'s half of the global batch of ``step`` (fixed, from its own generator)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(WORLD_SIZE * PER_RANK_BATCH, 3, 8, 8, generator=g)
    y = torch.randint(0, 4, (WORLD_SIZE * PER_RANK_BATCH, ), generator=g)
    part = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
    return x[part], y[part]


# ------------------------------------------------------------------ in the processes

def _observe_dtypes(model: nn.Module) -> Dict[str, Dict[str, str]]:
    """Hooks on every leaf module recording the dtypes it computes with, and its output's."""
    seen: Dict[str, Dict[str, str]] = {}

    def pre(name):
        def hook(module, args):
            seen[name] = dict(input=str(args[0].dtype), weight=str(module.weight.dtype))
            if isinstance(module, _BatchNorm):
                seen[name]['running_mean'] = str(module.running_mean.dtype)
        return hook

    def post(name):
        def hook(module, args, output):
            seen[name]['output'] = str(output.dtype)
        return hook

    for name, module in model.named_modules():
        if not list(module.children()):
            module.register_forward_pre_hook(pre(name))
            module.register_forward_hook(post(name))
    return seen


def _full_state(model: nn.Module) -> Dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _train(wrapper_cls, rank: int, **options) -> Dict[str, torch.Tensor]:
    model = wrapper_cls(_model(), **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return _full_state(model)


def _mixed_dtype_model() -> TinyResNet:
    """A model the user keeps in bf16 with fp32 batch norms (mixed parameter dtypes)."""
    model = _model().bfloat16()
    for m in model.modules():
        if isinstance(m, _BatchNorm):
            m.float()
    return model


def _distributed(rank_unused: int = 0) -> dict:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group('gloo')
    rank = dist.get_rank()
    out: dict = {}
    # (a) dtypes inside each module, one forward
    for name, cls, options in (
            ('fsdp2', MMFullyShard, dict(auto_wrap_policy=BLOCKS, mixed_precision=BF16)),
            ('fsdp1', MMFullyShardedDataParallel,
             dict(auto_wrap_policy=BLOCKS, mixed_precision=BF16)),
            ('fsdp2_groupnorm', MMFullyShard,
             dict(mixed_precision=dict(BF16, fp32_modules=['GroupNorm', 'LayerNorm'])))):
        model = GroupNormNet() if 'groupnorm' in name else _model()
        wrapped = cls(model, **options)
        seen = _observe_dtypes(model)
        wrapped(_batch(0, rank)[0]).float().sum().backward()
        out[f'dtypes/{name}'] = seen
    # fp32_modules=[] turns it off: BN in bf16 fails on the CPU, as before the option
    out['off'] = raised(lambda: MMFullyShard(_model(), mixed_precision=dict(
        BF16, fp32_modules=[]))(_batch(0, rank)[0]))
    # (b) training
    out['train/fsdp2'] = _train(MMFullyShard, rank, auto_wrap_policy=BLOCKS,
                                mixed_precision=BF16)
    out['train/fsdp1'] = _train(MMFullyShardedDataParallel, rank, auto_wrap_policy=BLOCKS,
                                mixed_precision=BF16)
    out['train/fsdp1_no_policy'] = _train(MMFullyShardedDataParallel, rank,
                                          mixed_precision=BF16)
    out['train/fsdp2_no_policy'] = _train(MMFullyShard, rank, mixed_precision=BF16)
    # (d) pytorch #156784: a bf16 model with fp32 BNs in one group trips torch's assertion ...
    raw = _mixed_dtype_model()
    fully_shard(raw, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out['156784/torch'] = raised(lambda: raw(_batch(0, rank)[0].bfloat16()))
    # ... which mmfsdp refuses at wrap time, before any collective, on every rank ...
    out['156784/refused'] = raised(lambda: MMFullyShard(
        _mixed_dtype_model(), mixed_precision=dict(BF16, fp32_modules=[])))
    # ... while the default fp32_modules gives each BN a group of its own, so it trains
    model = MMFullyShard(_mixed_dtype_model(), auto_wrap_policy=BLOCKS, mixed_precision=BF16)
    out['156784/default'] = raised(
        lambda: model(_batch(0, rank)[0]).float().sum().backward())
    return out


@pytest.fixture(scope='module')
def distributed() -> List[dict]:
    return run_distributed(_distributed, WORLD_SIZE, timeout=420)


# ------------------------------------------------------------------ one-process reference

def _reference(bf16: bool = True) -> List[Dict[str, torch.Tensor]]:
    """What 2 ranks train, on one process: per-rank halves, bf16 compute, fp32 BNs.

    Parameters stay fp32 and are cast to bf16 at each use (the cast's backward
    turns bf16 gradients into fp32 ones, as FSDP's reduce in fp32 does), except
    the batch norms', which run in fp32 on inputs cast up, their outputs cast
    back to bf16. Each rank keeps its own BN statistics (no SyncBatchNorm), so
    there is one model replica per rank for the buffers; the gradients of the
    two halves are averaged, as the data-parallel reduction does. ``bf16=False``
    trains everything in fp32 (the yardstick's yardstick).
    """
    low = torch.bfloat16 if bf16 else torch.float32
    replicas = [_model(), _model()]
    params = dict(replicas[0].named_parameters())
    bn_names = {n for n, m in replicas[0].named_modules() if isinstance(m, _BatchNorm)}
    for replica in replicas:
        for m in replica.modules():
            if isinstance(m, _BatchNorm):
                m.register_forward_pre_hook(lambda m, args: (args[0].float(), ))
                m.register_forward_hook(lambda m, args, out: out.to(low))
    optimizer = torch.optim.SGD(params.values(), lr=LR)
    for step in range(STEPS):
        for rank, replica in enumerate(replicas):
            x, y = _batch(step, rank)
            used = {n: p if n.rpartition('.')[0] in bn_names else p.to(low)
                    for n, p in params.items()}
            logits = functional_call(replica, used, (x.to(low), ))
            F.cross_entropy(logits.float(), y).backward()
        for p in params.values():
            p.grad /= WORLD_SIZE
        optimizer.step()
        optimizer.zero_grad()
    states = []
    for replica in replicas:
        state = {k: v.detach().clone() for k, v in replica.state_dict().items()}
        state.update({k: v.detach().clone() for k, v in params.items()})
        states.append(state)
    return states


# ------------------------------------------------------------------ distributed checks


# ------------------------------------------------------------------ resolution (no processes)

def test_default_keeps_every_batch_norm():
    for config in (FullyShardConfig, FSDPConfig):
        cfg = config.from_dict(dict(mixed_precision=BF16))
        assert cfg.fp32_modules == (_BatchNorm, )
        assert cfg.layout(_model()).fp32_modules == (
            'bn', 'blocks.0.bn1', 'blocks.0.bn2', 'blocks.1.bn1', 'blocks.1.bn2')
    sync = nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2))
    assert FullyShardConfig.from_dict(dict(mixed_precision=BF16)).layout(sync).fp32_modules \
        == ('1', )


def test_nothing_is_kept_without_low_precision_compute():
    for mp in (None, dict(reduce_dtype='bf16'), dict(param_dtype='fp32')):
        assert FullyShardConfig.from_dict(dict(mixed_precision=mp)).layout(
            _model()).fp32_modules == ()
    assert FSDPConfig.from_dict({}).layout(_model()).fp32_modules == ()


def test_names_and_classes_resolve_against_the_model():
    cfg = FullyShardConfig.from_dict(dict(mixed_precision=dict(
        BF16, fp32_modules=['GroupNorm', nn.LayerNorm])))
    assert cfg.mixed_precision == MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
    assert cfg.fp32_modules == ('GroupNorm', nn.LayerNorm)
    assert cfg.layout(GroupNormNet()).fp32_modules == ('gn', 'ln')
    # a base-class name covers its subclasses; [] keeps nothing
    for value, kept in ((['_BatchNorm'], 5), ('BatchNorm2d', 5), ([], 0)):
        cfg = FullyShardConfig.from_dict(dict(mixed_precision=dict(BF16, fp32_modules=value)))
        assert len(cfg.layout(_model()).fp32_modules) == kept


def test_fsdp1_mixed_precision_object_brings_its_classes():
    mp = MixedPrecision(param_dtype=torch.bfloat16, _module_classes_to_ignore=(nn.GroupNorm, ))
    cfg = FSDPConfig.from_dict(dict(mixed_precision=mp))
    assert cfg.fp32_modules == (nn.GroupNorm, )
    assert cfg.layout(GroupNormNet()).fp32_modules == ('gn', )


@pytest.mark.parametrize('value, error, fragment', [
    (dict(BF16, fp32_modules=None), TypeError,
     'mixed_precision.fp32_modules: None is ambiguous'),
    (dict(BF16, fp32_modules=3), TypeError,
     'mixed_precision.fp32_modules: expected a list of module class names'),
    (dict(BF16, fp32_modules=['GroupNorm', 1]), TypeError,
     'expected module class names'),
    (dict(BF16, fp32_module=['GroupNorm']), TypeError,
     "unknown key 'fp32_module' (did you mean 'fp32_modules'?)")])
def test_bad_values_name_the_key(value, error, fragment):
    for config in (FullyShardConfig, FSDPConfig):
        with pytest.raises(error) as e:
            config.from_dict(dict(mixed_precision=value))
        assert fragment in str(e.value)


def test_unknown_class_names_suggest_the_nearest():
    for config in (FullyShardConfig, FSDPConfig):
        cfg = config.from_dict(dict(mixed_precision=dict(BF16, fp32_modules=['BatchNrom2d'])))
        with pytest.raises(ValueError) as e:
            cfg.layout(_model())
        message = str(e.value)
        assert 'mixed_precision.fp32_modules' in message and "'BatchNrom2d'" in message
        assert "close matches: ['BatchNorm2d'" in message


def test_fp32_modules_at_the_top_level_points_into_mixed_precision():
    with pytest.raises(TypeError, match="'fp32_modules' is a key of mixed_precision"):
        FullyShardConfig.from_dict(dict(fp32_modules=['GroupNorm']))


def test_a_parameter_shared_across_the_fp32_boundary_is_refused():
    model = GroupNormNet()
    model.tied = nn.Linear(8, 8, bias=False)
    model.tied.weight = model.gn.weight  # shape (8,) vs (8, 8): only the registration matters
    cfg = FullyShardConfig.from_dict(dict(mixed_precision=dict(BF16,
                                                                fp32_modules=['GroupNorm'])))
    with pytest.raises(ValueError) as e:
        cfg.layout(model)
    assert 'gn.weight = tied.weight' in str(e.value) and 'kept in fp32 (gn)' in str(e.value)


def test_the_plan_counts_kept_modules_in_fp32():
    for wrapper in (MMFullyShard, MMFullyShardedDataParallel):
        spec = wrapper.sharding_spec(dict(auto_wrap_policy=BLOCKS, mixed_precision=BF16),
                                     _model(), WORLD_SIZE)
        assert spec.fp32_units == ('bn', 'blocks.0.bn1', 'blocks.0.bn2', 'blocks.1.bn1',
                                   'blocks.1.bn2')
        assert spec.units.index('blocks.0.bn1') < spec.units.index('blocks.0')
        plan = make_plan(_model(), spec, WORLD_SIZE)
        units = {u.name: u for u in plan.units}
        assert units['blocks.0.bn1'].numel == 16
        assert units['blocks.0.bn1'].gathered_bytes == 16 * 4  # fp32
        assert units['blocks.0'].numel == 2 * 8 * 8 * 9  # the convolutions only
        assert units['blocks.0'].gathered_bytes == 2 * 8 * 8 * 9 * 2  # bf16
        assert units[''].numel == 3 * 8 * 9 + 8 * 4 + 4  # stem + head; its BN is a unit


def test_reference_is_deterministic():
    """The one-process reference is the same each time (it is the yardstick)."""
    a, b = _reference(), _reference()
    assert max_abs_diff(a[0], b[0]) == 0.0 and max_abs_diff(a[1], copy.deepcopy(b[1])) == 0.0
