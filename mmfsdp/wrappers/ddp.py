"""``MMDistributedDataParallel``: torch's DDP for mmengine models, on any device."""
import contextlib
import inspect
from typing import Any, Iterator, List, Mapping, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..clip import clip_grads_by_global_norm
from ..options import check_keys
from ..plan.spec import Padding, ShardingSpec
from ..protocol import ParallelWrapper
from ..registry import MODEL_WRAPPERS
from .steps import DataParallelSteps, own_steps

__all__ = ['MMDistributedDataParallel']


@MODEL_WRAPPERS.register_module()
class MMDistributedDataParallel(DataParallelSteps, DistributedDataParallel, ParallelWrapper):
    """Distributed data parallel with mmengine's step interface, CPU included.

    Works under :class:`mmfsdp.FSDPRunner` and under mmengine's stock Runner,
    which passes ``device_ids=[LOCAL_RANK]``: the device is taken from the
    module instead (``None`` for a CPU module, which DDP requires).

    Config::

        model_wrapper_cfg = dict(
            type='mmfsdp.MMDistributedDataParallel',
            find_unused_parameters=False, static_graph=False,
            gradient_as_bucket_view=True, broadcast_buffers=False)

    Args:
        module: The model, already on its device.
        device_ids: Accepted for the stock Runner's sake; derived from the module.
        find_unused_parameters: Tolerate parameters without gradient.
        static_graph: Promise the same graph every iteration (enables
            optimisations). Gradient accumulation then synchronises the first
            micro-step, which DDP's static graph requires.
        gradient_as_bucket_view: Let gradients alias the reduction buckets.
        broadcast_buffers: Broadcast rank 0's buffers before each forward.
        bucket_cap_mb: Size of the gradient buckets.

    """

    def __init__(self,
                 module: nn.Module,
                 device_ids: Optional[List[int]] = None,
                 find_unused_parameters: bool = False,
                 static_graph: bool = False,
                 gradient_as_bucket_view: bool = True,
                 broadcast_buffers: bool = False,
                 bucket_cap_mb: Optional[float] = None) -> None:
        del device_ids
        _refuse_own_train_step(module)
        device = next(module.parameters()).device
        super().__init__(
            module,
            device_ids=None if device.type == 'cpu' else [device.index],
            find_unused_parameters=find_unused_parameters,
            static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view,
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=bucket_cap_mb)
        self._has_synced = False

    def train_step(self, data: Any, optim_wrapper: Any) -> dict:
        """One step of :class:`DataParallelSteps`, noting whether it synchronised."""
        log_vars = super().train_step(data, optim_wrapper)
        self._has_synced = self._has_synced or self.require_backward_grad_sync
        return log_vars

    def val_step(self, data: Any) -> list:
        """The module's own ``val_step``, as mmengine's DDP wrapper does.

        Every rank holds all parameters, so nothing needs the wrapper, and
        ``DDP.forward`` would make an evaluation batch a collective (buffer
        broadcast) where ranks may see different numbers of batches.
        """
        return self.module.val_step(data)

    def test_step(self, data: Any) -> list:
        """The module's own ``test_step`` (see :meth:`val_step`)."""
        return self.module.test_step(data)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction, except before the first synchronised backward.

        DDP's static graph must record one synchronised backward first; skipping
        the reduction before that trips an assert in its reducer.
        """
        if self.static_graph and not self._has_synced:
            yield
            return
        with super().no_sync():
            yield

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their norm (replicated: the local norm is the global one)."""
        return clip_grads_by_global_norm(self, self.parameters(), max_norm, norm_type)

    @classmethod
    def check_config(cls, config: Mapping[str, Any], module: Optional[nn.Module] = None) -> None:
        """Raise on unknown keywords and, with ``module``, on a model this wrapper cannot train."""
        check_keys(config, [n for n in inspect.signature(cls.__init__).parameters
                            if n not in ('self', 'module')], 'model_wrapper_cfg')
        if module is not None:
            _refuse_own_train_step(module)

    @classmethod
    def sharding_spec(cls, config: Mapping[str, Any], module: nn.Module,
                      world_size: int) -> ShardingSpec:
        """Every rank holds everything (see :mod:`mmfsdp.plan`)."""
        return ShardingSpec(
            wrapper='mmfsdp.MMDistributedDataParallel', strategy='REPLICATE', shard_size=1,
            replicate_size=world_size, units=(), padding=Padding.NONE, shard_params=False,
            shard_grads=False, shard_optimizer=False)


def _refuse_own_train_step(module: nn.Module) -> None:
    """One DDP over the model reduces only what flows through its forward.

    A model's own ``train_step`` calls its sub-modules directly, so DDP's
    reducer would never be prepared and gradients would stay per rank.
    """
    if 'train_step' in own_steps(module):
        raise ValueError(
            "model_wrapper_cfg.type='mmfsdp.MMDistributedDataParallel': "
            f'{type(module).__name__} defines its own train_step, which calls its sub-modules '
            'directly, past the DDP forward that reduces gradients. Use model_wrapper_cfg='
            "dict(type='MMSeparateDistributedDataParallel') (mmengine's DDP per child, as "
            "mmagic configs do), or 'mmfsdp.MMFullyShard' / 'mmfsdp.MMFullyShardedDataParallel'")
