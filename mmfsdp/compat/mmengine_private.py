"""The private mmengine API mmfsdp relies on, each use with its reason.

mmengine 0.10.7 has no public hook for what the sharded runner changes in
``Runner.train()``, ``CheckpointHook`` saving or ``OptimWrapper`` clipping.
"""
import contextlib
from collections import deque
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from mmengine.config.utils import MODULE2PACKAGE
from mmengine.hooks import CheckpointHook, EMAHook
from mmengine.model.weight_init import PretrainedInit, update_init_info
from mmengine.optim import OptimWrapper
from mmengine.runner import CheckpointLoader, Runner

__all__ = ['CheckpointHookSteps', 'RunnerSteps', 'checkpoint_loader_replaced_by', 'ema_started',
           'init_without_amp_checks', 'load_from', 'mark_checkpoint_loaded', 'norm_clip_options',
           'pretrained_init_calls', 'record_init_info', 'register_config_package',
           'replace_grad_clipping', 'resume_requested', 'set_fixed_loss_scale',
           'swap_ema_state_dict']


class RunnerSteps(Runner):
    """``Runner`` whose private ``train()`` step has a public name a subclass overrides."""

    def _init_model_weights(self) -> None:
        # why: Runner.train() calls this private step; no public hook replaces it
        self.init_model_weights()

    def init_model_weights(self) -> None:
        """The stock step: ``model.init_weights()``, then broadcast every tensor from rank 0."""
        Runner._init_model_weights(self)


def load_from(runner: Runner) -> Optional[str]:
    """The runner's ``load_from`` (``None`` when unset)."""
    return getattr(runner, '_load_from', None)  # why: Runner keeps it only as a private attribute


def resume_requested(runner: Runner) -> bool:
    """Whether the runner was asked to resume (``resume=True`` or ``'auto'``)."""
    return bool(getattr(runner, '_resume', False))  # why: Runner keeps it only privately


def mark_checkpoint_loaded(runner: Runner) -> None:
    """Record that a checkpoint was loaded, as mmengine's own ``load_checkpoint`` does."""
    runner._has_loaded = True  # why: load_or_resume() loads nothing a second time by this flag


class CheckpointHookSteps(CheckpointHook):
    """``CheckpointHook`` whose private save steps (overridable) and state have public names."""

    def _save_checkpoint_with_step(self, runner: Any, step: int, meta: dict) -> None:
        # why: every regular save and save_best's re-save go through this private method
        self.save_checkpoint_with_step(runner, step, meta)

    def save_checkpoint_with_step(self, runner: Any, step: int, meta: dict) -> None:
        """The stock step: delete the oldest kept checkpoint, then save ``step``'s."""
        CheckpointHook._save_checkpoint_with_step(self, runner, step, meta)

    def _save_best_checkpoint(self, runner: Any, metrics: Dict[str, Any]) -> None:
        # why: after_val_epoch calls this private method for save_best
        self.save_best_checkpoint(runner, metrics)

    def save_best_checkpoint(self, runner: Any, metrics: Dict[str, Any]) -> None:
        """The stock ``save_best``."""
        CheckpointHook._save_best_checkpoint(self, runner, metrics)

    def _publish_model(self, runner: Any, ckpt_path: str) -> None:
        # why: after_train calls this private method for published_keys
        self.publish_model(runner, ckpt_path)

    def publish_model(self, runner: Any, ckpt_path: str) -> None:
        """The stock step: publish a full checkpoint file."""
        CheckpointHook._publish_model(self, runner, ckpt_path)

    def init_rule(self, rules: Any, key_indicators: Any) -> None:
        """Resolve ``rule='auto'`` for ``key_indicators`` (mmengine's private ``_init_rule``)."""
        self._init_rule(rules, key_indicators)  # why: the only code that resolves 'auto' rules

    @property
    def kept_steps(self) -> deque:
        """Steps of the checkpoints kept under ``max_keep_ckpts > 0``, oldest first."""
        return self.keep_ckpt_ids  # why: set up (and restored on resume) by before_train only

    @property
    def name_template(self) -> str:
        """The regular checkpoints' file name template (``'iter_{}.pth'``)."""
        return self.filename_tmpl  # why: the template the hook resolved in __init__

    def checkpoint_name(self, step: int) -> str:
        """The regular checkpoint's file name for ``step``."""
        return self.name_template.format(step)

    def checkpoint_path(self, name: str) -> str:
        """``name`` under the output folder, joined by the hook's file backend."""
        return self.file_backend.join_path(self.out_dir, name)  # why: built by before_train

    @property
    def save_kwargs(self) -> Dict[str, Any]:
        """The hook's extra config keys, passed on to ``runner.save_checkpoint``."""
        return self.args  # why: the hook's **kwargs, which the stock saves forward


def ema_started(hook: EMAHook, runner: Any) -> bool:
    """Whether ``hook`` averages at this step (``begin_iter`` / ``begin_epoch`` reached)."""
    return hook._ema_started(runner)  # why: EMAHook decides it only in this private method


def swap_ema_state_dict(hook: EMAHook, checkpoint: Dict[str, Any]) -> None:
    """Exchange ``checkpoint``'s trained and averaged weights, as the stock hook saves them."""
    hook._swap_ema_state_dict(checkpoint)  # why: the stock format's one (private) definition


def norm_clip_options(wrapper: OptimWrapper) -> Optional[Dict[str, Any]]:
    """``clip_grad`` options of a wrapper that clips by norm; ``None`` for value or no clipping."""
    # why: OptimWrapper keeps clip_grad only as clip_func + clip_grad_kwargs
    if getattr(wrapper, 'clip_func', None) is not torch.nn.utils.clip_grad_norm_:
        return None
    return wrapper.clip_grad_kwargs


def replace_grad_clipping(wrapper: OptimWrapper, clip: Callable[[], None]) -> None:
    """Make ``wrapper.step()`` clip by calling ``clip()``."""
    # why: step() calls _clip_grad, which skips ranks without local gradients (a collective)
    wrapper._clip_grad = clip


def init_without_amp_checks(wrapper: OptimWrapper, **optim_kwargs: Any) -> None:
    """``OptimWrapper.__init__`` for an ``AmpOptimWrapper`` that sets its AMP state itself."""
    OptimWrapper.__init__(wrapper, **optim_kwargs)  # why: AmpOptimWrapper.__init__ asserts CUDA


def set_fixed_loss_scale(wrapper: OptimWrapper, scale: Optional[float]) -> None:
    """The scale ``AmpOptimWrapper.step`` keeps (``None``: dynamic scaling)."""
    wrapper._scale_update_param = scale  # why: step() passes it to loss_scaler.update()


def register_config_package(scope: str, module: str) -> None:
    """Let ``'<scope>::PATH'`` in configs resolve to ``<module's folder>/.mim/configs/PATH``."""
    # why: mmengine 0.10.7 accepts 'pkg::' only for the packages in this table
    MODULE2PACKAGE.setdefault(scope, module)


@contextlib.contextmanager
def pretrained_init_calls(call: Callable[[PretrainedInit, Any], None]) -> Iterator[None]:
    """Inside, mmengine's ``init_cfg`` ``Pretrained`` runs ``call(init, module)`` instead."""
    # why: replacing this initialiser's __call__ keeps mmengine's order of initialisers
    original = PretrainedInit.__call__
    PretrainedInit.__call__ = call
    try:
        yield
    finally:
        PretrainedInit.__call__ = original


def record_init_info(init: Any, module: Any) -> None:
    """Note ``init`` in the module's initialisation log, as mmengine's initialisers do."""
    # why: the log (_params_init_info) and an initialiser's _get_init_info are private
    if hasattr(module, '_params_init_info'):
        update_init_info(module, init_info=init._get_init_info())


@contextlib.contextmanager
def checkpoint_loader_replaced_by(read: Callable[..., Any]) -> Iterator[None]:
    """Inside, ``read(filename, map_location, logger)`` is mmengine's checkpoint loader."""
    # why: load_checkpoint, PretrainedInit and backbones' own init_weights (Swin) all read
    # through this classmethod, which unpickles URLs with torch.hub's weights_only=False
    original = CheckpointLoader.__dict__['load_checkpoint']
    CheckpointLoader.load_checkpoint = staticmethod(read)
    try:
        yield
    finally:
        CheckpointLoader.load_checkpoint = original
