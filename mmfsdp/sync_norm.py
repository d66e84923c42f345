"""``SyncNormHook`` for sharded models: mmdet's hook, averaging only what differs by rank.

mmdet's ``SyncNormHook`` (YOLOX's configs) all-reduces the concatenation of
every norm layer's ``state_dict()`` before validation. Sharded, a norm's weight
and bias are this rank's slice of a flat shard under FSDP1 (the ranks
all-reduce different sizes) and DTensors under FSDP2 (``torch.cat`` refuses
them beside the plain buffers). Those parameters are one tensor for all ranks
anyway (under DDP the mean leaves them as they are); what differs by rank are
the running statistics, buffers that no wrapper shards. This hook averages
those, summed and divided by the world size as the stock hook does (fp32
buffers give its result bit for bit), and needs no mmdet.
"""
from typing import Any

from mmengine.dist import all_reduce_params
from mmengine.hooks import Hook

from .compat import NORM_BASE
from .registry import HOOKS

__all__ = ['SyncNormHook']


@HOOKS.register_module()
class SyncNormHook(Hook):
    """Before each validation every rank's norm buffers become their mean over the ranks.

    ``FSDPRunner`` runs a config's ``dict(type='SyncNormHook')`` (mmdet's) as
    this hook, under every wrapper. The buffers (``running_mean``,
    ``running_var``, ``num_batches_tracked``) have the same sizes on every rank,
    whose models were checked to agree when wrapped; mmengine's
    ``all_reduce_params`` reduces them in the default process group, under its
    timeout (``env_cfg.dist_cfg.timeout``).
    """

    def before_val_epoch(self, runner: Any) -> None:
        """Average the buffers of every ``_NormBase`` (BatchNorm, SyncBN, InstanceNorm)."""
        all_reduce_params([b for m in runner.model.modules() if isinstance(m, NORM_BASE)
                           for b in m.buffers(recurse=False)], op='mean')
