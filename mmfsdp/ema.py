"""``EMAHook`` for sharded models: each rank averages only its own shards.

mmengine's ``EMAHook`` deep-copies the whole model on every rank and indexes its
parameters by name, which fails under FSDP1 (other names) and FSDP2 (DTensors).
This hook keeps the stock options, maths (the ``ema_type``'s own
``update_parameters``) and checkpoint format; ``ema_hook.ema_model.module`` holds
this rank's pieces of the average under the model's names.
"""
import contextlib
import copy
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence

import torch
from mmengine.dist import get_world_size, is_main_process
from mmengine.hooks import EMAHook as MMEngineEMAHook
from mmengine.model import is_model_wrapper
from mmengine.registry import MODELS
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from .agreement import fail_together
from .checkpoint.safe_io import UNSAFE_SWITCH, SafeFileSystemReader, load_shards
from .checkpoint.state import gather_full_state, load_full_model_state, sharded_state
from .compat import ema_started, fsdp1_reshard_if_gathered, resume_requested, swap_ema_state_dict
from .names import unwrapped_named_buffers, unwrapped_named_parameters
from .optim import is_sharded
from .registry import HOOKS

__all__ = ['EMA_SHARDS_KEY', 'EMAHook', 'configures_ema', 'ema_bytes_per_rank',
           'full_ema_entries', 'reshard']

#: Key of a sharded checkpoint's shards holding the averaged weights and ``steps``.
EMA_SHARDS_KEY = 'ema'
#: ``ema_state_dict`` keys of the stock hook: the averaged model's own, under this prefix.
_PREFIX = 'module.'


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local piece (on this rank) of a parameter or buffer, writable in place."""
    data = tensor.data
    return data.to_local() if isinstance(data, DTensor) else data


def ema_bytes_per_rank(model: nn.Module, update_buffers: bool = False) -> int:
    """Bytes of the averaged tensors this rank holds for ``model`` (wrapped or not)."""
    tensors = list(model.parameters()) + (list(model.buffers()) if update_buffers else [])
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def reshard(model: nn.Module) -> None:
    """Put every FSDP unit of ``model`` back into its sharded state (no-op elsewhere)."""
    # why: units stay gathered after a forward (the root; all under ZeRO-2), hiding the shards
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
        if isinstance(module, FullyShardedDataParallel):
            fsdp1_reshard_if_gathered(module)


def _source_tensors(model: nn.Module, update_buffers: bool) -> Dict[str, torch.Tensor]:
    """The local pieces of the model's parameters (and buffers), by the unwrapped names."""
    reshard(model)
    out = {name: _local(p) for name, p in unwrapped_named_parameters(model)}
    if update_buffers:
        out.update({name: _local(b) for name, b in unwrapped_named_buffers(model)})
    return out


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model inside a wrapper, as mmengine's ``EMAHook`` takes it."""
    return model.module if is_model_wrapper(model) else model


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
    tensors += [(name, b, False) for name, b in unwrapped_named_buffers(model)]
    for name, tensor, is_param in tensors:
        *path, leaf = name.split('.')
        owner = root
        for component in path:
            if not hasattr(owner, component):  # a child's name is no other attribute's
                owner.add_module(component, nn.Module())
            owner = getattr(owner, component)
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
    """The source model as ``update_parameters`` reads it: local pieces, buffers in its order."""

    def __init__(self, model: nn.Module, averaged: nn.Module, update_buffers: bool) -> None:
        self.tensors = _source_tensors(model, update_buffers)
        self._buffers = dict(unwrapped_named_buffers(model))
        self._order = [name for name, _ in unwrapped_named_buffers(averaged)]

    def named_parameters(self) -> Iterator:
        return iter(self.tensors.items())

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.tensors

    def buffers(self) -> Iterator:
        return (self._buffers[name] for name in self._order)


def full_ema_entries(state_dict: Dict[str, Any], averaged: Dict[str, Any],
                     steps: torch.Tensor) -> Dict[str, Any]:
    """``state_dict`` (averaged) / ``ema_state_dict`` (trained) as mmengine's hook writes them."""
    ema_state = {'steps': steps.detach().clone().cpu()}
    ema_state.update({_PREFIX + k: state_dict[k] for k in averaged})
    return dict(state_dict=dict(state_dict, **averaged), ema_state_dict=ema_state)


def _clone_shards(tree: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of a sharded state whose tensors alias the model (FSDP1's ShardedTensors: kept)."""
    return {k: v.detach().clone() if isinstance(v, DTensor) or type(v) in (
        torch.Tensor, nn.Parameter) else v for k, v in tree.items()}


def _has_ema_shards(path: str, allow_unsafe: bool) -> bool:
    metadata = SafeFileSystemReader(path, allow_unsafe).read_metadata()
    return any(key.startswith(f'{EMA_SHARDS_KEY}.') for key in metadata.state_dict_metadata)


@HOOKS.register_module()
class EMAHook(MMEngineEMAHook):
    """mmengine's ``EMAHook`` with a sharded averaged model; same options, same checkpoints.

    Config (unchanged from mmengine; ``FSDPRunner`` maps ``'EMAHook'`` here)::

        custom_hooks = [dict(type='EMAHook', ema_type='MomentumAnnealingEMA',
                             momentum=0.0002, gamma=100, update_buffers=False)]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model: Optional[nn.Module] = None
        self._averaged: Dict[str, torch.Tensor] = {}
        self._collected: Optional[Dict[str, Any]] = None

    # ---- averaging ----------------------------------------------------------------------

    def before_run(self, runner: Any) -> None:
        """Set ``src_model``; build ``ema_model`` as the stock hook does on one process.

        Under several processes ``ema_model`` starts empty, filled once the model is wrapped.
        """
        self.src_model = _unwrapped(runner.model)
        self._model, self._averaged = None, {}
        whole = not any(p.is_meta for p in self.src_model.parameters())
        if get_world_size() == 1 and whole and not is_sharded(runner.model):
            super().before_run(runner)
        else:
            self.ema_model = MODELS.build(self.ema_cfg, default_args=dict(model=nn.Module()))

    def _averaged_module(self, model: nn.Module) -> nn.Module:
        """``ema_model.module`` for ``model``: a copy of it, or its pieces when sharded."""
        device = self.ema_cfg.get('device')  # as the stock hook: the model's device by default
        if is_sharded(model):
            return _pieces_module(model, device)
        module = copy.deepcopy(_unwrapped(model)).requires_grad_(False)
        return module if device is None else module.to(device)

    def _averaged_tensors(self) -> Dict[str, torch.Tensor]:
        """The local tensors of ``ema_model.module`` that are averaged, by name."""
        module = self.ema_model.module  # a copy of the model keeps its layers' wrappers
        out = {name: _local(p) for name, p in unwrapped_named_parameters(module)}
        if self.ema_model.update_buffers:
            out.update({name: _local(b) for name, b in unwrapped_named_buffers(module)})
        return out

    def _materialise(self, runner: Any) -> None:
        """Fill ``ema_model.module`` (in place if it fits) from the wrapped model's pieces."""
        if self._model is runner.model:
            return
        wraps_ours = self._model is not None and any(
            m is self._model for m in runner.model.modules())
        self._model = runner.model
        if wraps_ours:  # wrapped once more (PrepareTTAHook): the same parameters, kept
            return
        self.src_model = _unwrapped(runner.model)
        sources = _source_tensors(runner.model, self.ema_model.update_buffers)
        if not _fits(self._averaged_tensors(), sources):
            self.ema_model.module = self._averaged_module(runner.model)
        self._averaged = self._averaged_tensors()
        buffers = dict(unwrapped_named_buffers(runner.model))
        with torch.no_grad():
            for key, averaged in self._averaged.items():
                averaged.copy_(sources[key])
            for name, buffer in unwrapped_named_buffers(self.ema_model.module):
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
        if ema_started(self, runner):
            self.ema_model.update_parameters(source)
            return
        with torch.no_grad():
            for key, averaged in self._averaged.items():
                averaged.copy_(source.tensors[key])

    def before_val_epoch(self, runner: Any) -> None:
        """Swap the averaged weights in for validation (and testing)."""
        self._materialise(runner)
        self._swap_averaged()

    def after_val_epoch(self, runner: Any, metrics: Optional[Dict[str, float]] = None) -> None:
        """Swap the trained weights back."""
        self._swap_averaged()

    before_test_epoch = before_val_epoch
    after_test_epoch = after_val_epoch

    @torch.no_grad()
    def _swap_averaged(self) -> None:
        """Exchange the averaged tensors with the model's local pieces, in place."""
        sources = _source_tensors(self._model, self.ema_model.update_buffers)
        for key, averaged in self._averaged.items():
            tmp = averaged.clone()
            averaged.copy_(sources[key])
            sources[key].copy_(tmp)

    @contextlib.contextmanager
    def _averaged_weights_in(self, runner: Any) -> Iterator[None]:
        """The averaged weights in the model's parameters for the body, then the trained ones."""
        self._materialise(runner)
        self._swap_averaged()
        try:
            yield
        finally:
            self._swap_averaged()

    # ---- checkpoints: the averaged weights swapped into the model, its state taken -------

    def averaged_state_dict(self, runner: Any, full: bool = True) -> Dict[str, Any]:
        """The averaged model's state dict (collective): gathered if ``full``, else DCP shards."""
        with self._averaged_weights_in(runner):
            if full:
                state = gather_full_state(runner.model, None)[0]
                return {k: v.detach().clone() for k, v in state.items()}
            return _clone_shards(sharded_state(runner.model, None)[0]['model'])

    def collect_checkpoint_state(self, runner: Any, checkpoint: Dict[str, Any],
                                 shards: Optional[Dict[str, Any]] = None) -> None:
        """Add the averaged model to a checkpoint being saved (every rank fails together)."""
        with fail_together('EMAHook.collect_checkpoint_state (the averaged model for the '
                           'checkpoint)'):
            self._collect(runner, checkpoint, shards)

    def _collect(self, runner: Any, checkpoint: Dict[str, Any],
                 shards: Optional[Dict[str, Any]]) -> None:
        averaged = self.averaged_state_dict(runner, full=shards is None)
        steps = self.ema_model.steps.detach().clone().cpu()
        if shards is not None:
            shards[EMA_SHARDS_KEY] = dict(state_dict=averaged, steps=steps)
        elif is_main_process():  # the other ranks' full copies are dropped here
            checkpoint.update(full_ema_entries(checkpoint['state_dict'], averaged, steps))
        self._collected = checkpoint

    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        """Nothing left to do when collected; else (the stock Runner, rank 0) collect here."""
        if self._collected is checkpoint:
            self._collected = None
            return
        self._collect(runner, checkpoint, None)

    def after_load_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        """Resume the averaged tensors from a full checkpoint, or restart them from the model."""
        if 'state_dict' not in checkpoint:
            return
        if not (resume_requested(runner) and 'ema_state_dict' in checkpoint):
            self._restart_from_model(runner)
            return
        swap_ema_state_dict(self, checkpoint)  # stock: back to trained / averaged
        ema_state = checkpoint['ema_state_dict']
        averaged = {k[len(_PREFIX):]: v for k, v in ema_state.items() if k.startswith(_PREFIX)}
        with self._averaged_weights_in(runner):
            missing, unexpected = load_full_model_state(runner.model, averaged,
                                                        self.strict_load)
        if self.strict_load and (missing or unexpected):
            raise KeyError(f'EMAHook(strict_load=True): ema_state_dict misses {missing}, '
                           f'has unexpected {unexpected}')
        self.ema_model.steps.copy_(ema_state['steps'])

    def after_load_checkpoint_shards(self, runner: Any, path: str,
                                     checkpoint: Dict[str, Any]) -> None:
        """Resume the averaged shards of a directory; ``load_from``: load them as the weights."""
        if not _has_ema_shards(path, _allows_unsafe(runner)):
            self._restart_from_model(runner)
            return
        if not resume_requested(runner):
            self._load_ema_shards(runner, path)
            self._restart_from_model(runner)
            return
        with self._averaged_weights_in(runner):
            steps = self._load_ema_shards(runner, path)
        self.ema_model.steps.copy_(steps)

    def _load_ema_shards(self, runner: Any, path: str) -> torch.Tensor:
        """Load the ``ema`` shards into the model's parameters; return the saved ``steps``."""
        template = sharded_state(runner.model, None)[0]['model']
        target = {EMA_SHARDS_KEY: dict(state_dict=template,
                                       steps=torch.zeros((), dtype=torch.long))}
        load_shards(target, path, _allows_unsafe(runner))
        set_model_state_dict(runner.model, target[EMA_SHARDS_KEY]['state_dict'],
                             options=StateDictOptions(full_state_dict=False,
                                                      strict=self.strict_load))
        return target[EMA_SHARDS_KEY]['steps']

    def _restart_from_model(self, runner: Any) -> None:
        """The averaged tensors start again from the model's (loaded) weights at first use."""
        self._model = None
        if hasattr(self, 'ema_model'):  # before_run has built it (not so for a bare load)
            self.ema_model.steps.zero_()


def _allows_unsafe(runner: Any) -> bool:
    return bool(runner.cfg.get(UNSAFE_SWITCH, False))


def configures_ema(custom_hooks: Optional[Sequence[Any]]) -> bool:
    """Whether a config's ``custom_hooks`` include an ``EMAHook`` (stock or mmfsdp's)."""
    names = ('EMAHook', 'mmfsdp.EMAHook', 'mmengine.EMAHook', MMEngineEMAHook, EMAHook)
    return any((h.get('type') if isinstance(h, Mapping) else type(h)) in names
               for h in custom_hooks or ())
