"""Activation checkpointing: layers whose activations are recomputed in backward.

Layers are named by class, as wrap policies do (a class, or the name of a class
found in the model)::

    model_wrapper_cfg = dict(
        type='mmfsdp.MMFullyShard',
        auto_wrap_policy=dict(type='transformer', layer_cls=['Block']),
        activation_checkpointing=dict(layer_cls=['Block'], mode='selective'))

There are three modes:

- ``'full'`` (default): each layer's forward is recomputed whole (torch's
  non-reentrant checkpoint, which composes with FSDP's hooks and ``no_sync``);
- ``'selective'``: the results of ``save_ops`` (by default the matrix
  multiplications, convolutions and attention kernels) are kept, the cheap ops
  between them recomputed (torch's selective activation checkpointing);
- ``'memory_budget'``: no layer is wrapped; torch.compile's partitioner keeps
  the activations of every compiled layer that fit ``memory_budget`` (0: keep
  as little as possible, 1: keep all) and recomputes the rest. It acts only
  inside compiled code, so it needs ``regional_compile`` (:mod:`mmfsdp.compile`).

The order is torchtitan's: each layer is wrapped in its checkpoint, the
wrapper is compiled (so the compiler sees the recomputation), then sharded
(:func:`mmfsdp.wrappers.base.prepare_layers`).
"""
import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

from .compat import NORM_BASE, CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper
from .options import one_or_many, option_dict, suggest

AC_KEY = 'model_wrapper_cfg.activation_checkpointing'
CHECKPOINT_MODES = ('full', 'selective', 'memory_budget')

#: What ``mode='selective'`` keeps unless ``save_ops`` says otherwise: the
#: expensive ops (matrix products, convolutions, attention), as torchtitan does.
DEFAULT_SAVE_OPS = ('aten.mm', 'aten.addmm', 'aten.bmm', 'aten.baddbmm', 'aten.convolution',
                    'aten._scaled_dot_product_flash_attention',
                    'aten._scaled_dot_product_flash_attention_for_cpu',
                    'aten._scaled_dot_product_efficient_attention',
                    'aten._scaled_dot_product_cudnn_attention')


def _op(name: Any) -> Optional[Any]:
    """The operator packet ``torch.ops.<namespace>.<op>`` for ``'namespace.op'``, or ``None``."""
    namespace, _, op = str(name).partition('.')
    try:
        return getattr(getattr(torch.ops, namespace), op) if op else None
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class ActivationCheckpointing:
    """``activation_checkpointing``, resolved (see the module docstring).

    Config::

        activation_checkpointing=dict(layer_cls=['Block'])                    # full
        activation_checkpointing=dict(layer_cls=['Block'], mode='selective',
                                      save_ops=['aten.mm', 'aten.convolution'])
        activation_checkpointing=dict(mode='memory_budget', memory_budget=0.5)
    """

    #: Layer classes (or class names) wrapped in a checkpoint; empty for ``'memory_budget'``.
    layer_cls: Tuple[Any, ...] = ()
    mode: str = 'full'
    #: ``'selective'``: the operators (``'aten.mm'``) whose results are kept.
    save_ops: Tuple[str, ...] = ()
    #: ``'memory_budget'``: the fraction of the activations the compiler may keep.
    memory_budget: Optional[float] = None

    @property
    def wraps_layers(self) -> bool:
        """Whether layers are wrapped in a checkpoint (``'full'`` or ``'selective'``)."""
        return self.mode != 'memory_budget'

    def checkpoint_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of ``torch.utils.checkpoint.checkpoint`` for this mode."""
        if self.mode != 'selective':
            return {}
        keep = {_op(name) for name in self.save_ops}

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return (CheckpointPolicy.MUST_SAVE if op.overloadpacket in keep
                    else CheckpointPolicy.PREFER_RECOMPUTE)

        return dict(context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


def resolve_activation_checkpointing(value: Any) -> Optional[ActivationCheckpointing]:
    """Resolve ``activation_checkpointing`` (class names are checked against the model later)."""
    if value is None or isinstance(value, ActivationCheckpointing):
        return value
    cfg = option_dict(value, ('layer_cls', 'mode', 'save_ops', 'memory_budget'), AC_KEY,
                      "None or dict(layer_cls=[...], mode='full'|'selective'|'memory_budget')")
    mode = cfg.get('mode', 'full')
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f'{AC_KEY}.mode: {mode!r} is not a mode{suggest(mode, CHECKPOINT_MODES)}; '
                         f'choose one of {", ".join(map(repr, CHECKPOINT_MODES))}')
    for key, allowed in (('save_ops', 'selective'), ('memory_budget', 'memory_budget')):
        if key in cfg and mode != allowed:
            raise TypeError(f'{AC_KEY}.{key} applies to mode={allowed!r} only (mode is {mode!r})')
    if mode == 'memory_budget':
        if 'layer_cls' in cfg:
            raise TypeError(f"{AC_KEY}: mode='memory_budget' wraps no layer (torch.compile's "
                            'partitioner decides what every compiled layer keeps); remove '
                            'layer_cls and name the layers in model_wrapper_cfg.regional_compile')
        budget = cfg.get('memory_budget')
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) \
                or not 0 <= budget <= 1:
            raise ValueError(f'{AC_KEY}.memory_budget: expected a number from 0 (keep as little '
                             f'as possible) to 1 (keep everything), got {budget!r}')
        return ActivationCheckpointing(mode=mode, memory_budget=float(budget))
    if not cfg.get('layer_cls'):
        raise TypeError(f"{AC_KEY}: missing 'layer_cls', the layer classes to checkpoint")
    given = cfg.get('save_ops')
    save_ops = () if given is None else one_or_many(given)
    unknown = [name for name in save_ops if not isinstance(name, str) or _op(name) is None]
    if given is not None and (unknown or not save_ops):
        raise ValueError(f'{AC_KEY}.save_ops: {unknown[0] if unknown else given!r} is '
                         "not an operator; name operators as 'namespace.op', e.g. "
                         f"{', '.join(map(repr, DEFAULT_SAVE_OPS[:5]))}")
    if mode == 'selective' and given is None:
        save_ops = tuple(name for name in DEFAULT_SAVE_OPS if _op(name) is not None)
    return ActivationCheckpointing(layer_cls=one_or_many(cfg['layer_cls']), mode=mode,
                                   save_ops=save_ops)


def apply_activation_checkpointing_to(
        model: nn.Module, layer_cls: Tuple[Type[nn.Module], ...],
        checkpointing: Optional[ActivationCheckpointing] = None,
        compiled: Tuple[Type[nn.Module], ...] = ()) -> None:
    """Wrap every ``layer_cls`` instance of ``model`` in a non-reentrant checkpoint of the mode.

    Recomputation runs a layer's norms again in training mode, which would
    update their running statistics twice per step; a layer run eagerly
    (not inside one of the ``compiled`` classes, whose compiled backward
    recomputes without the update) gets them back after its recomputation.
    """
    if not layer_cls:
        return
    kwargs = checkpointing.checkpoint_kwargs() if checkpointing is not None else {}
    in_compiled = {id(m) for layer in model.modules() if isinstance(layer, compiled)
                   for m in layer.modules()} if compiled else set()

    def wrap(layer: nn.Module) -> nn.Module:
        stats = [] if id(layer) in in_compiled else [
            buffer for m in layer.modules() if isinstance(m, NORM_BASE)
            for buffer in m.buffers(recurse=False)]
        kept = {'context_fn': functools.partial(
            _stats_kept_in_recompute, kwargs.get('context_fn', noop_context_fn), stats)}
        return checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                  **{**kwargs, **(kept if stats else {})})

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap,
                                   check_fn=lambda module: isinstance(module, layer_cls))


def _stats_kept_in_recompute(context_fn: Callable, stats: List[torch.Tensor]) -> Tuple[Any, Any]:
    """``context_fn``'s contexts, the recomputation's also putting ``stats`` back as they were."""
    forward, recompute = context_fn()
    if torch.compiler.is_compiling():  # compiled recomputation does not update them again
        return forward, recompute

    @contextlib.contextmanager
    def recomputing() -> Iterator[None]:
        saved = [buffer.clone() for buffer in stats]
        try:
            with recompute:
                yield
        finally:
            with torch.no_grad():
                for buffer, value in zip(stats, saved):
                    buffer.copy_(value)

    return forward, recomputing()
