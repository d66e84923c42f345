"""FSDP2's sharding procedure: which units get ``fully_shard``, in which order, how.

Free functions on resolved torch values (a mesh, policies), used by
:class:`mmfsdp.MMFullyShard` to shard and by its plan (:mod:`.specs`) to
describe the same units without sharding anything.
"""
import functools
from typing import List, Optional, Tuple, Type, Union

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..activation_checkpointing import apply_activation_checkpointing_to
from ..compat import checkpoint_inner
from ..policies import WrapPolicy, plan_units
from ..tied import merge_units_sharing_parameters

__all__ = ['shard_model', 'unit_plan']


def unit_plan(module: nn.Module, policy: Optional[WrapPolicy]) -> List[str]:
    """The units ``fully_shard`` is applied to, children first: the policy's, merged for ties."""
    units = plan_units(module, policy) if policy is not None else []
    return merge_units_sharing_parameters(module, units)[0]


def shard_model(module: nn.Module, mesh: DeviceMesh, policy: Optional[WrapPolicy],
                checkpoint_layers: Tuple[Type[nn.Module], ...], *,
                reshard_after_forward: Union[bool, int],
                mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy,
                roots: Optional[List[str]] = None) -> List[str]:
    """Apply ``fully_shard`` to the policy's units (children first), then to ``module``.

    With ``roots`` (children of ``module``), those are sharded as separate
    roots instead of ``module`` (:mod:`mmfsdp.wrappers.separate`). Units
    sharing a parameter are merged first (:mod:`mmfsdp.tied`); the
    checkpointed layers are wrapped before sharding, so a unit that is such a
    layer is sharded as its checkpoint wrapper. Returns the sharded unit names.
    """
    units = [name for name in unit_plan(module, policy) if name not in (roots or ())]
    targets = [module.get_submodule(name) for name in units]
    root_modules = [module.get_submodule(name) for name in roots or ()]
    apply_activation_checkpointing_to(module, checkpoint_layers)
    outer = {id(checkpoint_inner(m)): m for m in module.modules()
             if checkpoint_inner(m) is not None}
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp_policy,
                              offload_policy=offload_policy)
    for target in targets:
        shard(outer.get(id(target), target), reshard_after_forward=reshard_after_forward)
    # The root's parameters are needed first in backward: like torch's default,
    # keep them gathered after forward unless asked for ZeRO-2/groups explicitly.
    for root in root_modules or [module]:
        shard(outer.get(id(root), root), reshard_after_forward=None
              if reshard_after_forward is True else reshard_after_forward)
    return units
