"""FSDP1 wraps exactly the units its policy plans; FSDP2 under 'auto' trains as the hand list."""
import datetime

from harness import COLLECTIVE_TIMEOUT_S, max_abs_diff, run_distributed
from mmfsdp.policies import build_wrap_policy, plan_units
from toy import ToyClassifier


def _fsdp1_units(policy_cfg):
    """The submodules FSDP1 wraps, and the units plan_units names, for one model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    from mmfsdp import MMFullyShardedDataParallel
    from mmfsdp.names import unwrapped_name
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    planned = plan_units(ToyClassifier(dim=16, depth=3),
                         build_wrap_policy(policy_cfg, ToyClassifier(dim=16, depth=3)))
    wrapped = MMFullyShardedDataParallel.from_options(ToyClassifier(dim=16, depth=3),
                                         auto_wrap_policy=policy_cfg)
    built = [unwrapped_name(wrapped, f'{name}.x').rsplit('.', 1)[0]
             for name, m in wrapped.named_modules()
             if isinstance(m, FullyShardedDataParallel) and m is not wrapped]
    return built, planned


def test_fsdp1_wraps_exactly_the_planned_units():
    # 540: fc1 (544 parameters) is a unit, then the rest of its block (560) is one too.
    cfg = dict(type='size_based', min_num_params=540)
    [(built, planned)] = run_distributed(_fsdp1_units, 1, cfg)
    assert planned == ['blocks.0.fc1', 'blocks.0', 'blocks.1.fc1', 'blocks.1', 'blocks.2.fc1',
                       'blocks.2']
    assert sorted(built) == sorted(planned)


def _fsdp2_trains(policies):
    """Per policy: the fully_shard'ed modules, and the full parameters after three SGD steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from mmfsdp import MMFullyShard
    from mmfsdp.demo import GPT
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    results = []
    for policy in policies:
        torch.manual_seed(0)
        model = GPT(vocab_size=256, block_size=16, n_layer=3, n_head=2, n_embd=32)
        model.init_weights()
        wrapped = MMFullyShard.from_options(model, auto_wrap_policy=policy)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
        tokens = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            x = torch.randint(0, 256, (4, 16), generator=tokens)
            wrapped(x, x.roll(-1, 1), mode='loss')['loss'].backward()
            optimizer.step()
            optimizer.zero_grad()
        results.append(([n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n],
                        {n: p.full_tensor() for n, p in wrapped.named_parameters()}))
    dist.destroy_process_group()
    return results


def test_fsdp2_auto_trains_equal_to_the_hand_written_class_list():
    hand = dict(type='transformer', layer_cls=['TransformerBlock'])
    [(auto, listed), _] = run_distributed(_fsdp2_trains, 2, ['auto', hand])
    assert auto[0] == listed[0] == ['blocks.0', 'blocks.1', 'blocks.2']
    assert max_abs_diff(auto[1], listed[1]) == 0.0


def _attention_trains(policy):
    """Per wrapper: the units, and the full parameters after three SGD steps of a model with
    ``nn.MultiheadAttention`` against the same steps on the whole batch in this process."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    from contract_models import AttentionClassifier
    from mmfsdp import MMFullyShard, MMFullyShardedDataParallel
    from mmfsdp.checkpoint.state import gather_full_state
    from mmfsdp.names import unwrapped_name
    from toy import IN_DIM, NUM_CLASSES
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, IN_DIM, generator=data),
                torch.randint(0, NUM_CLASSES, (8, ), generator=data)) for _ in range(3)]
    torch.manual_seed(0)
    reference = AttentionClassifier(dim=16, depth=3)
    reference.init_weights()
    results = {}
    for name, wrapper in (('fsdp1', MMFullyShardedDataParallel), ('fsdp2', MMFullyShard)):
        model = copy.deepcopy(reference)
        wrapped = wrapper.from_options(model, auto_wrap_policy=policy)
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.5)
        for x, y in batches:
            part = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
            wrapped(x[part], y[part], mode='loss')['loss'].backward()
            optimizer.step()
            optimizer.zero_grad()
        units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule) and n]
        if name == 'fsdp1':
            units = [unwrapped_name(wrapped, f'{n}.x').rsplit('.', 1)[0]
                     for n, m in wrapped.named_modules()
                     if isinstance(m, FullyShardedDataParallel) and m is not wrapped]
        results[name] = (units, gather_full_state(wrapped, None)[0])
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for x, y in batches:
        reference(x, y, mode='loss')['loss'].backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()
    return dict(results, reference=reference.state_dict())


def test_multihead_attention_stays_whole_and_trains_equal_to_one_process():
    """Before: size_based made ``attn.out_proj`` a unit, and attention read its shard:
    FSDP2 ``aten.addmm.default got mixed torch.Tensor and DTensor``, FSDP1 ``mat2 must be
    a matrix``."""
    policy = dict(type='size_based', min_num_params=200)
    ranks = run_distributed(_attention_trains, 2, policy)
    for name in ('fsdp1', 'fsdp2'):
        units, state = ranks[0][name]
        assert sorted(units) == ['attn', 'blocks.0.fc1', 'blocks.0.fc2', 'blocks.1.fc1',
                                 'blocks.1.fc2', 'blocks.2.fc1', 'blocks.2.fc2'], name
        diff = max_abs_diff(state, ranks[0]['reference'])
        print(f'{name}: max abs diff to one process {diff:.1e}')
        assert diff < 1e-6
