"""``save_checkpoint`` / ``load_checkpoint`` / ``resume`` for :class:`mmfsdp.FSDPRunner`.

The stock versions save on rank 0 alone and load rank 0's view everywhere.
These take every rank through the gather or the scatter, read and write the
formats of :mod:`mmfsdp.checkpoint`, and keep everything else of mmengine's
behaviour (meta, message hub, schedulers, hooks, ``CheckpointHook`` options).
"""
import os.path as osp
import re
import time
from typing import Any, Dict, Optional, Sequence, Tuple

import mmengine
import torch.distributed as dist
from mmengine.dist import is_main_process
from mmengine.hooks import CheckpointHook as MMEngineCheckpointHook
from mmengine.hooks import EMAHook as MMEngineEMAHook

from ..ema import EMAHook
from ..names import for_tta_model, model_state_names
from ..together import control_group, fail_together
from .durable import remove_stale_temporaries
from .hook import CheckpointHook
from .integrity import find_complete_checkpoint
from .safe_io import (
    UNSAFE_SWITCH,
    decode_message_hub,
    encode_message_hub,
    load_file,
    save_atomically,
)
from .sharded import META_FILE, is_sharded_checkpoint, load_sharded, read_sharded_meta, save_sharded
from .state import (
    StateDictType,
    gather_full_state,
    load_full_model_state,
    load_full_optimizer_state,
    optimizer_extras,
    resolve_state_dict_type,
)

__all__ = ['CheckpointMixin', 'DEFAULT_SAVE_TIMEOUT_S']

#: How long the other ranks wait for rank 0 to write a checkpoint, by default:
#: generous, because it bounds only a save that is slow but alive (a rank that
#: fails or dies fails the others at once); the process group's timeout (e.g.
#: 300 s) is sized for collectives and would kill a healthy multi-GB save.
DEFAULT_SAVE_TIMEOUT_S = 3600.0


def resolve_save_timeout(value: Any) -> float:
    """``save_timeout``: positive seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise TypeError(f'default_hooks.checkpoint.save_timeout: expected positive seconds, '
                        f'got {value!r}')
    return float(value)


#: Stock hooks (by config type) that FSDPRunner replaces with its own, same options.
_REPLACED_HOOKS = {'CheckpointHook': CheckpointHook, MMEngineCheckpointHook: CheckpointHook,
                   'EMAHook': EMAHook, MMEngineEMAHook: EMAHook}


class CheckpointMixin:
    """Checkpointing for a Runner whose model may be sharded.

    Save either type from the stock hook::

        default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1000,
                                             state_dict_type='sharded'))  # or 'full'

    ``load_from`` and ``resume`` accept a full file, a sharded directory, or an
    ordinary mmengine checkpoint (the latter needs ``allow_unsafe_checkpoints = True``
    in the config when it pickles mmengine or numpy classes).
    """

    def register_hook(self, hook: Any, priority: Any = None) -> None:
        """Register a hook; stock hooks that break under sharding become mmfsdp's.

        - ``CheckpointHook`` -> :class:`mmfsdp.checkpoint.CheckpointHook`: same
          options, but the expired checkpoint is deleted only after the new one
          is complete;
        - ``EMAHook`` -> :class:`mmfsdp.ema.EMAHook`: same options, each rank
          averages its own shards.
        """
        if isinstance(hook, dict):
            replacement = _REPLACED_HOOKS.get(hook.get('type'))
            if replacement is not None:
                hook = dict(hook, type=replacement)
        super().register_hook(hook, priority)

    def save_checkpoint(self,
                        out_dir: str,
                        filename: str,
                        file_client_args: Optional[Dict] = None,
                        save_optimizer: bool = True,
                        save_param_scheduler: bool = True,
                        meta: Optional[Dict] = None,
                        by_epoch: bool = True,
                        backend_args: Optional[Dict] = None,
                        state_dict_type: str = 'full',
                        save_timeout: float = DEFAULT_SAVE_TIMEOUT_S) -> None:
        """Save a checkpoint; every rank calls it (as ``CheckpointHook`` does).

        Args mirror ``Runner.save_checkpoint``, plus ``state_dict_type``:
        ``'full'`` (one file written by rank 0) or ``'sharded'`` (a directory
        with every rank's shards), and ``save_timeout``: seconds the other ranks
        wait for rank 0's writes (a rank that fails or dies fails all ranks at
        once, whatever this is). Only local paths are supported.
        """
        kind = resolve_state_dict_type(state_dict_type)
        wait_s = resolve_save_timeout(save_timeout)
        if file_client_args is not None or backend_args is not None:
            raise ValueError('default_hooks.checkpoint: FSDPRunner writes checkpoints to local '
                             'paths only; remove file_client_args / backend_args')
        path = osp.join(out_dir, filename)
        optim_wrapper = self.optim_wrapper if save_optimizer else None
        checkpoint: Dict[str, Any] = dict(meta=self._checkpoint_meta(meta, by_epoch),
                                          message_hub=encode_message_hub(self.message_hub))
        if save_param_scheduler and self.param_schedulers is not None:
            checkpoint['param_schedulers'] = self._scheduler_states()
        if kind is StateDictType.FULL:
            checkpoint['state_dict'], optimizer = gather_full_state(self.model, optim_wrapper)
            if optimizer is not None:
                checkpoint['optimizer'] = optimizer
            # hooks with sharded state of their own (EMAHook) gather it, on every rank
            self.call_hook('collect_checkpoint_state', checkpoint=checkpoint)
            with fail_together(f'saving checkpoint {path}', wait_s):
                if is_main_process():
                    self.call_hook('before_save_checkpoint', checkpoint=checkpoint)
                    save_atomically(checkpoint, path)
                    remove_stale_temporaries(out_dir)
        else:
            if optim_wrapper is not None:
                checkpoint['optimizer_extras'] = optimizer_extras(optim_wrapper)
            extra_shards: Dict[str, Any] = {}
            self.call_hook('collect_checkpoint_state', checkpoint=checkpoint,
                           shards=extra_shards)
            with fail_together(f'before_save_checkpoint hooks for {path}'):
                if is_main_process():
                    self.call_hook('before_save_checkpoint', checkpoint=checkpoint)
            save_sharded(path, self.model, optim_wrapper, checkpoint, wait_s, extra_shards)

    def load_checkpoint(self,
                        filename: str,
                        map_location: Any = 'cpu',
                        strict: bool = False,
                        revise_keys: Sequence[Tuple[str, str]] = ((r'^module.', ''), )
                        ) -> Dict:
        """Load model weights from a full file, a sharded directory or an mmengine file.

        Weights go straight into the (possibly sharded) model; each rank keeps
        only its shard. ``map_location`` is accepted for compatibility: files
        are read to the CPU and copied to the parameters' devices.
        """
        allow_unsafe = bool(self.cfg.get(UNSAFE_SWITCH, False))
        if is_sharded_checkpoint(filename):
            checkpoint = read_sharded_meta(filename, allow_unsafe)
            self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
            load_sharded(filename, self.model, strict=strict)
            self.call_hook('after_load_checkpoint_shards', path=filename, checkpoint=checkpoint)
        else:
            checkpoint = load_file(filename, allow_unsafe)
            self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
            state = checkpoint.get('state_dict', checkpoint)
            own = model_state_names(self.model)  # a model's own child may be called 'module'
            for pattern, replacement in revise_keys:
                state = {k if k in own else re.sub(pattern, replacement, k): v
                         for k, v in state.items()}
            state = for_tta_model(state, own)
            missing, unexpected = load_full_model_state(self.model, state, strict)
            if missing or unexpected:
                self.logger.warning(f'Loaded {filename} with missing keys {missing} and '
                                    f'unexpected keys {unexpected}')
        if 'message_hub' in checkpoint:
            checkpoint['message_hub'] = decode_message_hub(checkpoint['message_hub'])
        self._loaded_checkpoint = (filename, checkpoint)
        self._has_loaded = True
        self.logger.info(f'Load checkpoint from {filename}')
        return checkpoint

    def resume(self,
               filename: str,
               resume_optimizer: bool = True,
               resume_param_scheduler: bool = True,
               map_location: Any = 'default') -> None:
        """Mmengine's ``resume``, with the optimizer state loaded at any world size.

        Auto-resume (``resume=True`` without ``load_from``) skips an incomplete
        latest checkpoint for the newest complete one before it, with a warning
        (:mod:`.integrity`).
        """
        if getattr(self, '_load_from', None) is None:
            filename = self._complete_checkpoint(filename)
        super().resume(filename, resume_optimizer=False,
                       resume_param_scheduler=resume_param_scheduler, map_location='cpu')
        if not resume_optimizer or isinstance(self.optim_wrapper, dict):
            return
        path, checkpoint = self._loaded_checkpoint
        if is_sharded_checkpoint(path) and 'optimizer_param_groups' in checkpoint:
            load_sharded(path, self.model, self.optim_wrapper, meta=checkpoint)
        elif 'optimizer' in checkpoint:
            load_full_optimizer_state(self.model, self.optim_wrapper, checkpoint['optimizer'])

    def _complete_checkpoint(self, filename: str) -> str:
        """Rank 0 picks the checkpoint to auto-resume from; every rank gets its choice."""
        with fail_together('choosing the checkpoint to resume from'):
            chosen = [find_complete_checkpoint(filename, META_FILE, self.logger.warning)
                      if is_main_process() else None]
        if dist.is_initialized():
            dist.broadcast_object_list(chosen, src=0, group=control_group())
        return chosen[0]

    def _checkpoint_meta(self, meta: Optional[Dict], by_epoch: bool) -> Dict[str, Any]:
        """The ``meta`` entry of the stock Runner's checkpoints."""
        meta = dict(meta or {})
        meta.setdefault('epoch', self.epoch + 1 if by_epoch else self.epoch)
        meta.setdefault('iter', self.iter if by_epoch else self.iter + 1)
        meta.update(cfg=self.cfg.pretty_text, seed=self.seed,
                    experiment_name=self.experiment_name,
                    time=time.strftime('%Y%m%d_%H%M%S', time.localtime()),
                    mmengine_version=mmengine.__version__)
        dataset = getattr(self.train_dataloader, 'dataset', None)
        if hasattr(dataset, 'metainfo'):
            meta['dataset_meta'] = dataset.metainfo
        return meta

    def _scheduler_states(self) -> Any:
        if isinstance(self.param_schedulers, dict):
            return {name: [s.state_dict() for s in schedulers]
                    for name, schedulers in self.param_schedulers.items()}
        return [s.state_dict() for s in self.param_schedulers]
