"""The averaged model of ``EMAHook``: this rank's pieces of the wrapped model's tensors.

The averaged model is a dict of tensors, one per parameter of the *wrapped*
model, shaped like this rank's local piece of it (FSDP1: the
``use_orig_params`` view of the flat shard; FSDP2: the DTensor's local shard;
DDP / one process: the whole tensor). So EMA costs each rank the bytes of its
parameter shards (the sharding plan states them).

The averaging itself is mmengine's: the configured ``ema_type``
(``ExponentialMovingAverage``, ``MomentumAnnealingEMA``,
``StochasticWeightAverage`` or any ``BaseAveragedModel``) is built around an
empty module and its ``update_parameters`` runs on the local tensors.
Validation and test swap the averaged tensors into the model in place.
"""
import contextlib
from typing import Any, Dict, Iterator, Optional

import torch
from mmengine.hooks import EMAHook as MMEngineEMAHook
from mmengine.registry import MODELS
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from ..compat import fsdp1_reshard_if_gathered

__all__ = ['ShardedAveraging', 'ema_bytes_per_rank', 'reshard', 'source_tensors']


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local piece (on this rank) of a parameter or buffer, writable in place."""
    data = tensor.data
    return data.to_local() if isinstance(data, DTensor) else data


def ema_bytes_per_rank(model: nn.Module, update_buffers: bool = False) -> int:
    """Bytes of the averaged tensors this rank holds for ``model`` (wrapped or not)."""
    tensors = list(model.parameters()) + (list(model.buffers()) if update_buffers else [])
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def reshard(model: nn.Module) -> None:
    """Put every FSDP unit of ``model`` back into its sharded state (no-op elsewhere).

    The root unit (FSDP1 and FSDP2) and every unit under SHARD_GRAD_OP /
    ``reshard_after_forward=False`` stay gathered after a forward until the
    next backward; after a validation forward that is until the next training
    step. The parameters then hold the gathered tensors, and a write into the
    shards would be hidden behind them, so the shards are re-registered first.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
        if isinstance(module, FullyShardedDataParallel):
            fsdp1_reshard_if_gathered(module)


def source_tensors(model: nn.Module, update_buffers: bool) -> Dict[str, torch.Tensor]:
    """The averaged tensors' keys -> this rank's pieces of the model's tensors."""
    reshard(model)
    out = {f'p{i}': _local(p) for i, p in enumerate(model.parameters())}
    if update_buffers:
        out.update({f'b{i}': _local(b) for i, b in enumerate(model.buffers())})
    return out


class _LocalShards:
    """What ``BaseAveragedModel.update_parameters`` reads of a model: here, local shards.

    ``update_parameters`` takes ``named_parameters()`` (or ``state_dict()``
    with ``update_buffers``) and ``buffers()`` of the source model; this
    provides them as this rank's pieces, under the averaged tensors' keys.
    Buffers are kept in step by the hook itself, so ``buffers()`` is empty
    (as is the averaged model's, an empty module).
    """

    def __init__(self, model: nn.Module, update_buffers: bool) -> None:
        self.tensors = source_tensors(model, update_buffers)

    def named_parameters(self) -> Iterator:
        return iter(self.tensors.items())

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.tensors

    def buffers(self) -> Iterator:
        return iter(())


class ShardedAveraging(MMEngineEMAHook):
    """mmengine's ``EMAHook`` averaging this rank's shards; checkpoints are the subclass's.

    Not registered: :class:`mmfsdp.ema.EMAHook` adds the checkpoint interplay
    (:mod:`mmfsdp.ema.checkpoint`), which the stock methods would get wrong.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model: Optional[nn.Module] = None
        self._averaged: Dict[str, torch.Tensor] = {}

    def before_run(self, runner: Any) -> None:
        """Build the ``ema_type`` object around an empty module: no copy of the model."""
        self.ema_model = MODELS.build(self.ema_cfg, default_args=dict(model=nn.Module()))
        self._model = None

    def _materialise(self, runner: Any) -> None:
        """Make the averaged tensors from the wrapped model's local pieces, once it exists."""
        if self._model is runner.model:
            return
        wraps_ours = self._model is not None and any(
            m is self._model for m in runner.model.modules())
        self._model = runner.model
        if wraps_ours:  # wrapped once more (PrepareTTAHook): the same parameters, kept
            return
        device = self.ema_cfg.get('device')  # as the stock hook: the model's device by default
        sources = source_tensors(runner.model, self.ema_model.update_buffers)
        self._averaged = {k: t.detach().clone() if device is None else t.detach().to(device,
                                                                                    copy=True)
                          for k, t in sources.items()}
        self.ema_model.avg_parameters = self._averaged

    @property
    def src_model(self) -> nn.Module:
        """The model being averaged (the wrapped one, once wrapped)."""
        return self._model

    def before_train(self, runner: Any) -> None:
        """Check ``begin_iter`` / ``begin_epoch``, then make the averaged tensors."""
        super().before_train(runner)
        self._materialise(runner)

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        """Average this rank's pieces (mmengine's ``update_parameters``), or copy before begin."""
        self._materialise(runner)
        source = _LocalShards(runner.model, self.ema_model.update_buffers)
        if self._ema_started(runner):
            self.ema_model.update_parameters(source)
            return
        with torch.no_grad():
            for key, averaged in self._averaged.items():
                averaged.copy_(source.tensors[key])

    def before_val_epoch(self, runner: Any) -> None:
        """Swap the averaged weights in for validation."""
        self._materialise(runner)
        self._swap_ema_parameters()

    def after_val_epoch(self, runner: Any, metrics: Optional[Dict[str, float]] = None) -> None:
        """Swap the trained weights back."""
        self._swap_ema_parameters()

    def before_test_epoch(self, runner: Any) -> None:
        """Swap the averaged weights in for testing."""
        self._materialise(runner)
        self._swap_ema_parameters()

    def after_test_epoch(self, runner: Any, metrics: Optional[Dict[str, float]] = None) -> None:
        """Swap the trained weights back."""
        self._swap_ema_parameters()

    @torch.no_grad()
    def _swap_ema_parameters(self) -> None:
        """Exchange the averaged tensors with the model's local pieces, in place."""
        sources = source_tensors(self._model, self.ema_model.update_buffers)
        for key, averaged in self._averaged.items():
            tmp = averaged.clone()
            averaged.copy_(sources[key])
            sources[key].copy_(tmp)

    @contextlib.contextmanager
    def _averaged_weights_in(self, runner: Any) -> Iterator[None]:
        """The averaged weights in the model's parameters for the body, then the trained ones."""
        self._materialise(runner)
        self._swap_ema_parameters()
        try:
            yield
        finally:
            self._swap_ema_parameters()
