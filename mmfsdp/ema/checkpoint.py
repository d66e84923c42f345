"""``EMAHook``'s averaged model in checkpoints: saved, resumed and loaded at any world size.

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

Collecting the averaged model for a save is collective and runs on every rank
(:meth:`EMAHook.collect_checkpoint_state`); a rank that fails there fails every
rank at once (:func:`mmfsdp.together.fail_together`), rather than leaving the
others waiting in the save's next collective.
"""
from typing import Any, Dict, Optional

import torch
import torch.distributed.checkpoint as dcp
from mmengine.dist import is_main_process
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from ..checkpoint.state import gather_full_state, load_full_model_state, sharded_state
from ..compat import resume_requested
from ..registry import HOOKS
from ..together import fail_together
from .averaging import ShardedAveraging

__all__ = ['EMA_SHARDS_KEY', 'EMAHook', 'full_ema_entries']

#: Key of a sharded checkpoint's shards holding the trained weights and ``steps``.
EMA_SHARDS_KEY = 'ema'
#: ``ema_state_dict`` keys of the stock hook: the averaged model's own, under this prefix.
_PREFIX = 'module.'


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


def _has_ema_shards(path: str) -> bool:
    metadata = dcp.FileSystemReader(path).read_metadata()
    return any(key.startswith(f'{EMA_SHARDS_KEY}.') for key in metadata.state_dict_metadata)


@HOOKS.register_module()
class EMAHook(ShardedAveraging):
    """mmengine's ``EMAHook`` with a sharded averaged model; same options, same checkpoints.

    Config (unchanged from mmengine; ``FSDPRunner`` maps ``'EMAHook'`` here)::

        custom_hooks = [dict(type='EMAHook', ema_type='MomentumAnnealingEMA',
                             momentum=0.0002, gamma=100, update_buffers=False)]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._collected: Optional[Dict[str, Any]] = None

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
        beside the model's. If any rank raises here, every rank raises.
        """
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
        """Nothing left to do when the checkpoint was collected; else collect it here.

        The fallback serves runners that do not call
        :meth:`collect_checkpoint_state` and call this on rank 0 only, as the
        stock Runner does: it skips the exchange between ranks, and is
        collective-free only without a sharded wrapper.
        """
        if self._collected is checkpoint:
            self._collected = None
            return
        self._collect(runner, checkpoint, None)

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
