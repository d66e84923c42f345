"""FSDP1 wraps exactly the units its wrap policy plans."""
import datetime

from harness import COLLECTIVE_TIMEOUT_S, run_distributed
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
