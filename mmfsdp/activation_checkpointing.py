"""Activation checkpointing by layer class, shared by the FSDP wrappers.

Checkpointed layers keep only their inputs for backward and recompute the rest,
trading compute for activation memory. torch's non-reentrant implementation is
used: it composes with FSDP's hooks and with ``no_sync``, which the reentrant
one does not.

Config::

    activation_checkpointing=dict(layer_cls=['TransformerBlock'])
"""
import functools
from typing import Any, Mapping, Optional, Tuple, Type

from torch import nn

from .compat import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper
from .options import check_keys, resolve_module_classes

__all__ = ['resolve_activation_checkpointing', 'apply_activation_checkpointing_to']

KEY = 'model_wrapper_cfg.activation_checkpointing'


def resolve_activation_checkpointing(cfg: Optional[Mapping[str, Any]],
                                     model: nn.Module) -> Tuple[Type[nn.Module], ...]:
    """Resolve ``activation_checkpointing=dict(layer_cls=[...])`` against ``model``.

    Returns the layer classes to checkpoint; empty for ``None`` (off).
    """
    if cfg is None:
        return ()
    if not isinstance(cfg, Mapping):
        raise TypeError(f'{KEY}: expected None or dict(layer_cls=[...]), got '
                        f'{type(cfg).__name__} {cfg!r}')
    check_keys(cfg, ('layer_cls', ), KEY)
    if 'layer_cls' not in cfg:
        raise TypeError(f"{KEY}: missing 'layer_cls', the layer classes to checkpoint")
    return resolve_module_classes(cfg['layer_cls'], model, f'{KEY}.layer_cls')


def apply_activation_checkpointing_to(model: nn.Module,
                                      layer_cls: Tuple[Type[nn.Module], ...]) -> None:
    """Wrap every ``layer_cls`` instance in ``model`` in a non-reentrant checkpoint."""
    if layer_cls:
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
            check_fn=lambda module: isinstance(module, layer_cls))
