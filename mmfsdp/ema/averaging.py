"""The averaged model of ``EMAHook``: ``ema_model.module``, this rank's pieces of the model.

As with mmengine's hook, ``ema_hook.ema_model`` is the configured ``ema_type``
(``ExponentialMovingAverage``, ``MomentumAnnealingEMA``,
``StochasticWeightAverage`` or any ``BaseAveragedModel``), ``ema_hook.src_model``
the unwrapped model, and ``ema_model.module`` holds the averaged parameters
under the model's own names. What ``ema_model.module`` is depends on how the
model holds its parameters:

- one process (and DDP): the stock object, a copy of the model (built in
  ``before_run`` on one process, as the stock hook does; at the start of
  training under several processes, once the model is wrapped);
- sharded (FSDP1, FSDP2): a module of plain containers with the model's
  parameter and buffer names, each parameter this rank's piece of the
  average, shaped as the model's own on this rank (FSDP2: a ``DTensor`` with
  the parameter's mesh and placements, so ``full_tensor()`` gives the whole
  average; FSDP1: the ``use_orig_params`` 1-D view of the flat shard, possibly
  empty). Each rank holds only its shards' bytes (the sharding plan states
  them); :meth:`mmfsdp.ema.EMAHook.averaged_state_dict` gathers them.

The averaging itself is mmengine's: the ``ema_type``'s ``update_parameters``
runs on the local pieces, by name. Validation and test swap the averaged
pieces into the model in place.
"""
import contextlib
import copy
from typing import Any, Dict, Iterator, Optional

import torch
from mmengine.dist import get_world_size
from mmengine.hooks import EMAHook as MMEngineEMAHook
from mmengine.model import is_model_wrapper
from mmengine.registry import MODELS
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from ..compat import fsdp1_reshard_if_gathered, registered_buffers
from ..names import module_tree, unwrapped_name, unwrapped_named_parameters

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


def _named_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every buffer of ``model`` (wrapped or not), under the unwrapped model's name."""
    out: Dict[str, torch.Tensor] = {}
    seen = set()
    for path, module in module_tree(model):
        for name, buffer in registered_buffers(module):
            if buffer is not None and id(buffer) not in seen:
                seen.add(id(buffer))
                out[unwrapped_name(model, f'{path}.{name}' if path else name)] = buffer
    return out


def source_tensors(model: nn.Module, update_buffers: bool) -> Dict[str, torch.Tensor]:
    """The pieces on this rank of the model's parameters (and buffers, with ``update_buffers``).

    Keyed by the unwrapped model's names, as the averaged tensors are.
    """
    reshard(model)
    out = {name: _local(p) for name, p in unwrapped_named_parameters(model)}
    if update_buffers:
        out.update({name: _local(b) for name, b in _named_buffers(model).items()})
    return out


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a wrapper, as mmengine's ``EMAHook`` takes it."""
    return model.module if is_model_wrapper(model) else model


def _is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules())


def _piece(param: torch.Tensor, device: Optional[str]) -> torch.Tensor:
    """A copy of this rank's piece of ``param`` for the averaged module (a DTensor stays one)."""
    data = param.detach()
    if isinstance(data, DTensor):
        local = data.to_local().to(device, copy=True) if device else data.to_local().clone()
        return DTensor.from_local(local, data.device_mesh, data.placements, run_check=False,
                                  shape=data.shape, stride=data.stride())
    return data.to(device, copy=True) if device else data.clone()


def _pieces_module(model: nn.Module, device: Optional[str]) -> nn.Module:
    """Plain containers holding copies of this rank's pieces, under the unwrapped names."""
    root = nn.Module()
    tensors = [(name, p, True) for name, p in unwrapped_named_parameters(model)]
    tensors += [(name, b, False) for name, b in _named_buffers(model).items()]
    for name, tensor, is_param in tensors:
        *path, leaf = name.split('.')
        owner = root
        for component in path:
            if component not in owner._modules:
                owner.add_module(component, nn.Module())
            owner = owner.get_submodule(component)
        piece = _piece(tensor, device)
        if is_param:
            owner.register_parameter(leaf, nn.Parameter(piece, requires_grad=False))
        else:
            owner.register_buffer(leaf, piece)
    return root


def _fits(averaged: Dict[str, torch.Tensor], sources: Dict[str, torch.Tensor]) -> bool:
    """Whether the averaged tensors can take the sources' values in place."""
    return averaged.keys() == sources.keys() and all(
        a.shape == s.shape and a.dtype == s.dtype and a.device.type != 'meta'
        for a, s in ((averaged[k], sources[k]) for k in sources))


class _LocalShards:
    """What ``BaseAveragedModel.update_parameters`` reads of a model: here, local pieces.

    ``update_parameters`` takes ``named_parameters()`` (or ``state_dict()``
    with ``update_buffers``) and ``buffers()`` of the source model; this
    provides them as this rank's pieces, under the unwrapped model's names,
    and the buffers in the order of the averaged module's own, which
    ``update_parameters`` pairs them with.
    """

    def __init__(self, model: nn.Module, averaged: nn.Module, update_buffers: bool) -> None:
        self.tensors = source_tensors(model, update_buffers)
        self._buffers = _named_buffers(model)
        self._order = [name for name, _ in averaged.named_buffers()]

    def named_parameters(self) -> Iterator:
        return iter(self.tensors.items())

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.tensors

    def buffers(self) -> Iterator:
        return (self._buffers[name] for name in self._order)


class ShardedAveraging(MMEngineEMAHook):
    """mmengine's ``EMAHook`` averaging this rank's pieces; checkpoints are the subclass's.

    Not registered: :class:`mmfsdp.ema.EMAHook` adds the checkpoint interplay
    (:mod:`mmfsdp.ema.checkpoint`), which the stock methods would get wrong.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model: Optional[nn.Module] = None
        self._averaged: Dict[str, torch.Tensor] = {}

    def before_run(self, runner: Any) -> None:
        """Set ``src_model`` and build ``ema_model``, as the stock hook does, on one process.

        Under several processes the model is wrapped (and maybe sharded) later,
        so no full copy is made here: ``ema_model`` starts around an empty
        module, which :meth:`_materialise` replaces once the model is wrapped.
        """
        self.src_model = _unwrapped(runner.model)
        self._model, self._averaged = None, {}
        whole = not any(p.is_meta for p in self.src_model.parameters())
        if get_world_size() == 1 and whole and not _is_sharded(runner.model):
            super().before_run(runner)
        else:
            self.ema_model = MODELS.build(self.ema_cfg, default_args=dict(model=nn.Module()))

    def _averaged_module(self, model: nn.Module) -> nn.Module:
        """``ema_model.module`` for ``model``: a copy of it, or its pieces when sharded."""
        device = self.ema_cfg.get('device')  # as the stock hook: the model's device by default
        if _is_sharded(model):
            return _pieces_module(model, device)
        module = copy.deepcopy(_unwrapped(model)).requires_grad_(False)
        return module if device is None else module.to(device)

    def _averaged_tensors(self) -> Dict[str, torch.Tensor]:
        """The local tensors of ``ema_model.module`` that are averaged, by name."""
        module = self.ema_model.module
        out = {name: _local(p) for name, p in module.named_parameters()}
        if self.ema_model.update_buffers:
            out.update({name: _local(b) for name, b in module.named_buffers()})
        return out

    def _materialise(self, runner: Any) -> None:
        """Fill ``ema_model.module`` from the model's local pieces, once the model is wrapped.

        The module is kept (and written in place) when it fits the pieces, as
        the one-process copy of :meth:`before_run` does; else it is built anew.
        """
        if self._model is runner.model:
            return
        wraps_ours = self._model is not None and any(
            m is self._model for m in runner.model.modules())
        self._model = runner.model
        if wraps_ours:  # wrapped once more (PrepareTTAHook): the same parameters, kept
            return
        self.src_model = _unwrapped(runner.model)
        sources = source_tensors(runner.model, self.ema_model.update_buffers)
        if not _fits(self._averaged_tensors(), sources):
            self.ema_model.module = self._averaged_module(runner.model)
        self._averaged = self._averaged_tensors()
        buffers = _named_buffers(runner.model)
        with torch.no_grad():
            for key, averaged in self._averaged.items():
                averaged.copy_(sources[key])
            for name, buffer in self.ema_model.module.named_buffers():
                buffer.copy_(_local(buffers[name]))
        self.ema_model.avg_parameters = self._averaged

    def before_train(self, runner: Any) -> None:
        """Check ``begin_iter`` / ``begin_epoch``, then make the averaged tensors."""
        super().before_train(runner)
        self._materialise(runner)

    def after_train_iter(self, runner: Any, batch_idx: int, data_batch: Any = None,
                         outputs: Optional[dict] = None) -> None:
        """Average this rank's pieces (mmengine's ``update_parameters``), or copy before begin."""
        self._materialise(runner)
        source = _LocalShards(runner.model, self.ema_model.module,
                              self.ema_model.update_buffers)
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
