"""``EMAHook`` for sharded models: each rank averages only its own shards.

mmengine's ``EMAHook`` deep-copies the whole model on every rank and indexes
its parameters by name: under FSDP1 the names differ (``KeyError``), under
FSDP2 the parameters are DTensors (mixed Tensor/DTensor error), and every rank
holds a full copy. This hook keeps the same options, the same maths and the
same checkpoint format, but its averaged model is a list of tensors, one per
parameter of the *wrapped* model, shaped like this rank's local piece of it
(FSDP1: the ``use_orig_params`` view of the flat shard; FSDP2: the DTensor's
local shard; DDP / one process: the whole tensor). So EMA costs each rank the
bytes of its parameter shards (the sharding plan states them).

The averaging itself is mmengine's: the configured ``ema_type``
(``ExponentialMovingAverage``, ``MomentumAnnealingEMA``,
``StochasticWeightAverage`` or any ``BaseAveragedModel``) is built around an
empty module and its ``update_parameters`` runs on the local tensors.

Checkpoints go through the model's own state-dict machinery: the averaged
tensors are swapped into the model's parameters (in place, on every rank),
the model's full or sharded state is taken, and they are swapped back.

- Full files hold ``ema_state_dict`` and ``state_dict`` exactly as the stock
  hook writes them (``state_dict`` holds the averaged weights,
  ``ema_state_dict`` the trained ones under ``module.`` keys, plus ``steps``).
- Sharded directories add an ``ema`` entry beside the ``model`` shards: the
  averaged weights' shards and ``steps``. ``load_from`` such a directory loads
  the averaged weights into the model, as ``load_from`` a full file does; both
  reshard at any world size; ``python -m mmfsdp.consolidate`` turns a
  directory into the full format above.

``FSDPRunner`` uses this hook wherever a config asks for ``EMAHook``::

    custom_hooks = [dict(type='EMAHook', ema_type='ExponentialMovingAverage',
                         momentum=0.0002)]
"""
import contextlib
from typing import Any, Dict, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed.checkpoint as dcp
from mmengine.dist import is_main_process
from mmengine.hooks import EMAHook as MMEngineEMAHook
from mmengine.registry import MODELS
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

from .checkpoint.state import gather_full_state, load_full_model_state, sharded_state
from .compat import fsdp1_reshard_if_gathered, resume_requested
from .registry import HOOKS

__all__ = ['EMA_SHARDS_KEY', 'EMAHook', 'configures_ema', 'ema_bytes_per_rank',
           'full_ema_entries', 'reshard']

#: Key of a sharded checkpoint's shards holding the trained weights and ``steps``.
EMA_SHARDS_KEY = 'ema'
#: ``ema_state_dict`` keys of the stock hook: the averaged model's own, under this prefix.
_PREFIX = 'module.'


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local piece (on this rank) of a parameter or buffer, writable in place."""
    data = tensor.data
    return data.to_local() if isinstance(data, DTensor) else data


def configures_ema(custom_hooks: Optional[Sequence[Any]]) -> bool:
    """Whether a config's ``custom_hooks`` include an ``EMAHook`` (stock or mmfsdp's)."""
    names = ('EMAHook', 'mmfsdp.EMAHook', 'mmengine.EMAHook', MMEngineEMAHook, EMAHook)
    return any((h.get('type') if isinstance(h, Mapping) else type(h)) in names
               for h in custom_hooks or ())


def ema_bytes_per_rank(model: nn.Module, update_buffers: bool = False) -> int:
    """Bytes of the averaged tensors this rank holds for ``model`` (wrapped or not)."""
    tensors = list(model.parameters()) + (list(model.buffers()) if update_buffers else [])
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


class _LocalShards:
    """What ``BaseAveragedModel.update_parameters`` reads of a model: here, local shards.

    ``update_parameters`` takes ``named_parameters()`` (or ``state_dict()``
    with ``update_buffers``) and ``buffers()`` of the source model; this
    provides them as this rank's pieces, under the averaged tensors' keys.
    Buffers are kept in step by :class:`EMAHook` itself, so ``buffers()`` is
    empty (as is the averaged model's, an empty module).
    """

    def __init__(self, model: nn.Module, update_buffers: bool) -> None:
        self.tensors = _source_tensors(model, update_buffers)

    def named_parameters(self) -> Iterator:
        return iter(self.tensors.items())

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return self.tensors

    def buffers(self) -> Iterator:
        return iter(())


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


def _source_tensors(model: nn.Module, update_buffers: bool) -> Dict[str, torch.Tensor]:
    """The averaged tensors' keys -> this rank's pieces of the model's tensors."""
    reshard(model)
    out = {f'p{i}': _local(p) for i, p in enumerate(model.parameters())}
    if update_buffers:
        out.update({f'b{i}': _local(b) for i, b in enumerate(model.buffers())})
    return out


def full_ema_entries(state_dict: Dict[str, Any], averaged: Dict[str, Any],
                     steps: torch.Tensor) -> Dict[str, Any]:
    """``state_dict`` / ``ema_state_dict`` of a full checkpoint, as mmengine's hook writes them.

    ``state_dict`` is the trained model's full state, ``averaged`` the same
    keys with the averaged weights. The stock hook saves the averaged model's
    state dict (``steps`` and ``module.<key>``) and then swaps it with
    ``state_dict`` key by key, so that ``state_dict`` deploys the averaged
    weights; the result here is the same.
    """
    ema_state = {'steps': steps.detach().clone().cpu()}
    ema_state.update({_PREFIX + k: state_dict[k] for k in averaged})
    return dict(state_dict=dict(state_dict, **averaged), ema_state_dict=ema_state)


def _clone_shards(tree: Dict[str, Any]) -> Dict[str, Any]:
    """A copy of a sharded state whose tensors alias the model (DTensors, plain tensors).

    FSDP1's ShardedTensors are built afresh by every state-dict call and are kept.
    """
    return {k: v.detach().clone() if isinstance(v, DTensor) or type(v) in (
        torch.Tensor, nn.Parameter) else v for k, v in tree.items()}


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

    # -- the averaged tensors ------------------------------------------------------------------

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
        sources = _source_tensors(runner.model, self.ema_model.update_buffers)
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
        sources = _source_tensors(self._model, self.ema_model.update_buffers)
        for key, averaged in self._averaged.items():
            tmp = averaged.clone()
            averaged.copy_(sources[key])
            sources[key].copy_(tmp)

    @contextlib.contextmanager
    def _averaged_weights_in(self, runner: Any) -> Iterator[None]:
        self._materialise(runner)
        self._swap_ema_parameters()
        try:
            yield
        finally:
            self._swap_ema_parameters()

    # -- checkpoints ---------------------------------------------------------------------------

    def averaged_state_dict(self, runner: Any, full: bool = True) -> Dict[str, Any]:
        """The averaged model's state dict, keyed like the unwrapped model's (collective).

        ``full``: gathered, unsharded tensors (on every rank, as the model's own
        full state is); else this rank's shards, in the form
        ``torch.distributed.checkpoint`` saves. Buffers are the model's
        unless ``update_buffers`` averages them.
        """
        with self._averaged_weights_in(runner):
            if full:
                state = gather_full_state(runner.model, None)[0]
                return {k: v.detach().clone() for k, v in state.items()}
            return _clone_shards(sharded_state(runner.model, None)[0]['model'])

    def collect_checkpoint_state(self, runner: Any, checkpoint: Dict[str, Any],
                                 shards: Optional[Dict[str, Any]] = None) -> None:
        """Add the averaged model to a checkpoint being saved (every rank; collective).

        Called by :class:`mmfsdp.checkpoint.CheckpointMixin` on every rank
        before rank 0's ``before_save_checkpoint``: for a full file,
        ``checkpoint['state_dict']`` (gathered) is swapped with the averaged
        weights on rank 0, as the stock hook does; for a sharded directory,
        the averaged shards and ``steps`` go into ``shards['ema']``, saved
        beside the model's.
        """
        averaged = self.averaged_state_dict(runner, full=shards is None)
        steps = self.ema_model.steps.detach().clone().cpu()
        if shards is not None:
            shards[EMA_SHARDS_KEY] = dict(state_dict=averaged, steps=steps)
        elif is_main_process():  # the other ranks' full copies are dropped here
            checkpoint.update(full_ema_entries(checkpoint['state_dict'], averaged, steps))
        self._collected = checkpoint

    def before_save_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        """Nothing left to do when the checkpoint was collected; else collect it here.

        The fallback serves runners that do not call
        :meth:`collect_checkpoint_state` (it is collective-free only without a
        sharded wrapper).
        """
        if self._collected is checkpoint:
            self._collected = None
            return
        self.collect_checkpoint_state(runner, checkpoint)

    def after_load_checkpoint(self, runner: Any, checkpoint: dict) -> None:
        """Resume the averaged tensors from a full checkpoint (every rank).

        Without ``ema_state_dict`` (or when only loading weights), the averaged
        tensors start from the loaded model, as with the stock hook. Sharded
        directories are read in :meth:`after_load_checkpoint_shards`.
        """
        if 'state_dict' not in checkpoint:
            return
        if not (resume_requested(runner) and 'ema_state_dict' in checkpoint):
            self._restart_from_model(runner)
            return
        self._swap_ema_state_dict(checkpoint)  # stock: back to trained / averaged
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
        """Read the averaged shards of a sharded directory, after the model's (collective).

        Resuming, they become the averaged tensors again. Only loading weights
        (``load_from``), they replace the model's, as a full file's
        ``state_dict`` would, and the average starts again from them.
        """
        if not _has_ema_shards(path):
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
        dcp.load(target, checkpoint_id=path)
        set_model_state_dict(runner.model, target[EMA_SHARDS_KEY]['state_dict'],
                             options=StateDictOptions(full_state_dict=False,
                                                      strict=self.strict_load))
        return target[EMA_SHARDS_KEY]['steps']

    def _restart_from_model(self, runner: Any) -> None:
        """The averaged tensors start again from the model's (loaded) weights at first use."""
        self._model = None
        if hasattr(self, 'ema_model'):  # before_run has built it (not so for a bare load)
            self.ema_model.steps.zero_()


def _has_ema_shards(path: str) -> bool:
    metadata = dcp.FileSystemReader(path).read_metadata()
    return any(key.startswith(f'{EMA_SHARDS_KEY}.') for key in metadata.state_dict_metadata)

