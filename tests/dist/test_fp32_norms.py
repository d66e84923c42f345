"""``mixed_precision.fp32_modules``: norms compute in fp32 under bf16 mixed precision.

One 2-process gloo group runs every distributed check (starting interpreters is
the cost): the dtypes each module sees under FSDP2 and FSDP1, a small ResNet
trained under FSDP2, FSDP1 (with and without a wrap policy), and the #156784
configurations. The one-process reference is built here from plain torch, not
from mmfsdp: parameters cast to bf16 per use, batch norms in fp32 with their
input cast up and their output cast back, one replica of the buffers per rank.
"""
import copy
from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm

from harness import max_abs_diff, raised, run_distributed
from mmfsdp import MMFullyShard, MMFullyShardedDataParallel
from vision import GroupNormNet, TinyResNet, tiny_resnet

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke

WORLD_SIZE = 2
PER_RANK_BATCH = 4
STEPS = 4
LR = 0.1
BF16 = dict(param_dtype='bf16', reduce_dtype='fp32')
BLOCKS = dict(type='transformer', layer_cls=['Block'])
#: FSDP2 against the one-process reference: the same bf16 kernels on the same
#: per-rank batches, fp32 optimizer arithmetic. A bf16 convolution's weight
#: gradient may still round one element one bf16 ulp apart (its gradient output
#: reaches it through FSDP2's autograd hooks, possibly with other strides): one
#: ulp of a gradient of ~4e-3 is 2**-8 x 4e-3 ~ 1.6e-5, x lr 0.1 = 1.6e-6 per
#: step. Measured: 1.5e-6, one element of blocks.1.conv1.weight, both ranks.
#: Training everything in fp32 instead lands > 1e-3 away (checked below).
TOL_REFERENCE = 1e-5
#: FSDP2 against FSDP1's default MixedPrecision: the same dtypes everywhere, so
#: the same bound as against the reference (a bf16 gradient element one ulp apart
#: moves a weight by ~1.6e-6 per step). Measured: 0.0 (bitwise equal), both ranks,
#: with and without a wrap policy.
TOL_FSDP1 = TOL_REFERENCE


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
    model = wrapper_cls.from_options(tiny_resnet(), **options)
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
    model = tiny_resnet().bfloat16()
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
        model = GroupNormNet() if 'groupnorm' in name else tiny_resnet()
        wrapped = cls.from_options(model, **options)
        seen = _observe_dtypes(model)
        wrapped(_batch(0, rank)[0]).float().sum().backward()
        out[f'dtypes/{name}'] = seen
    # (c) the norms of one block are one group: gathered together when the first one runs
    model = tiny_resnet()
    MMFullyShard.from_options(model, auto_wrap_policy=BLOCKS, mixed_precision=BF16)
    first, gathered = model.blocks[0], {}
    first.bn1.register_forward_pre_hook(lambda *_: gathered.update({
        name: not isinstance(bn.weight, DTensor) for name, bn in (
            ('bn1', first.bn1), ('bn2', first.bn2), ('next block', model.blocks[1].bn1))}))
    model(_batch(0, rank)[0])
    out['gathered with blocks.0.bn1'] = gathered
    # fp32_modules=[] turns it off: BN in bf16 fails on the CPU, as before the option
    out['off'] = raised(lambda: MMFullyShard.from_options(tiny_resnet(), mixed_precision=dict(
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
    out['156784/refused'] = raised(lambda: MMFullyShard.from_options(
        _mixed_dtype_model(), mixed_precision=dict(BF16, fp32_modules=[])))
    # ... while the default fp32_modules gives each BN a group of its own, so it trains
    model = MMFullyShard.from_options(_mixed_dtype_model(), auto_wrap_policy=BLOCKS,
                                      mixed_precision=BF16)
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
    replicas = [tiny_resnet(), tiny_resnet()]
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

@pytest.mark.parametrize('name', ['fsdp2', 'fsdp1'])
def test_kept_modules_compute_in_fp32_and_the_rest_in_bf16(distributed, name):
    for rank, result in enumerate(distributed):
        seen = result[f'dtypes/{name}']
        bns = [n for n, dtypes in seen.items() if 'running_mean' in dtypes]
        assert len(bns) == 5 and len(seen) == 11  # stem, head, 4 convs, 5 BNs
        for module, dtypes in seen.items():
            if module in bns:
                assert dtypes == dict(input='torch.float32', weight='torch.float32',
                                      running_mean='torch.float32',
                                      output='torch.bfloat16'), (rank, module, dtypes)
            else:  # convolutions and the head
                assert dtypes == dict(input='torch.bfloat16', weight='torch.bfloat16',
                                      output='torch.bfloat16'), (rank, module, dtypes)


def test_groupnorm_and_layernorm_are_kept_when_named(distributed):
    seen = distributed[0]['dtypes/fsdp2_groupnorm']
    assert seen['gn']['input'] == seen['gn']['weight'] == 'torch.float32'
    assert seen['ln']['input'] == seen['ln']['weight'] == 'torch.float32'
    assert seen['gn']['output'] == seen['ln']['output'] == 'torch.bfloat16'
    assert seen['conv']['weight'] == seen['head']['weight'] == 'torch.bfloat16'


def test_the_norms_of_one_block_are_one_group(distributed):
    """One all-gather for a block's norms (ResNet-50: 17 norm groups, not 53)."""
    for result in distributed:
        assert result['gathered with blocks.0.bn1'] == {'bn1': True, 'bn2': True,
                                                        'next block': False}


def test_an_empty_list_turns_it_off(distributed):
    assert distributed[0]['off'] == ('RuntimeError',
                                     'expected scalar type BFloat16 but found Float')


def test_fsdp2_trains_what_one_process_with_fp32_norms_trains(distributed):
    reference = _reference()
    for rank, result in enumerate(distributed):
        for name in ('train/fsdp2', 'train/fsdp2_no_policy'):
            diff = max_abs_diff(result[name], reference[rank])
            print(f'{name} rank {rank} vs one process: max abs diff {diff:.2e}')
            assert diff <= TOL_REFERENCE
    # the check has teeth: bf16 compute is visible, the weights and BN statistics
    # moved, and differ per rank
    diff = max_abs_diff(distributed[0]['train/fsdp2'], _reference(bf16=False)[0])
    print(f'fsdp2 (bf16) vs one process in fp32: max abs diff {diff:.2e}')
    assert diff > 100 * TOL_REFERENCE
    first = tiny_resnet().state_dict()
    assert max_abs_diff(reference[0], {k: v.to(reference[0][k].dtype)
                                       for k, v in first.items()}) > 1e-2
    assert max_abs_diff(reference[0], reference[1]) > 1e-3


def test_fsdp2_trains_what_fsdp1_default_mixed_precision_trains(distributed):
    for rank, result in enumerate(distributed):
        for name in ('train/fsdp1', 'train/fsdp1_no_policy'):
            diff = max_abs_diff(result['train/fsdp2'], result[name])
            print(f'fsdp2 vs {name} rank {rank}: max abs diff {diff:.2e}')
            assert diff <= TOL_FSDP1


def test_a_group_with_mixed_dtypes_is_refused_before_torch_asserts(distributed):
    for result in distributed:
        kind, message = result['156784/torch']
        assert kind == 'AssertionError' and 'uniform original parameter dtype' in message
        kind, message = result['156784/refused']
        assert kind == 'ValueError', message
        assert "FSDP2 group 'TinyResNet (root)'" in message and '#156784' in message
        assert "float32: ['bn.weight', 'bn.bias'" in message and "bfloat16: ['stem.weight'" \
            in message
        assert result['156784/default'] == (None, None)


# ------------------------------------------------------------------ the yardstick


def test_reference_is_deterministic():
    """The one-process reference is the same each time (it is the yardstick)."""
    a, b = _reference(), _reference()
    assert max_abs_diff(a[0], b[0]) == 0.0 and max_abs_diff(a[1], copy.deepcopy(b[1])) == 0.0
