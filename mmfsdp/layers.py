"""What is done to repeated layers before sharding: activation checkpointing, regional compile.

Both options name layers by class, as wrap policies do (a class, or the name of
a class found in the model)::

    model_wrapper_cfg = dict(
        type='mmfsdp.MMFullyShard',
        auto_wrap_policy=dict(type='transformer', layer_cls=['Block']),
        activation_checkpointing=dict(layer_cls=['Block'], mode='selective'),
        regional_compile=dict(layer_cls=['Block'], fullgraph=True))

``activation_checkpointing`` recomputes activations in backward instead of
keeping them, in one of three modes:

- ``'full'`` (default): each layer's forward is recomputed whole (torch's
  non-reentrant checkpoint, which composes with FSDP's hooks and ``no_sync``);
- ``'selective'``: the results of ``save_ops`` (by default the matrix
  multiplications, convolutions and attention kernels) are kept, the cheap ops
  between them recomputed (torch's selective activation checkpointing);
- ``'memory_budget'``: no layer is wrapped; torch.compile's partitioner keeps
  the activations of every compiled layer that fit ``memory_budget`` (0: keep
  as little as possible, 1: keep all) and recomputes the rest. It acts only
  inside compiled code, so it needs ``regional_compile``.

``regional_compile`` compiles each layer of the named classes with
``nn.Module.compile`` (the other keys are ``torch.compile``'s; ``dynamic``
defaults to ``False``: one static graph per layer shape): repeated layers
share one small graph, compiled once, and the wrapper's collectives stay
outside it. The names of parameters and checkpoints do not change.
``compile=True`` at the top level of a config keeps mmengine's meaning
(the whole ``train_step``); the two are not combined.

The order is torchtitan's: each layer is wrapped in its checkpoint, the
wrapper is compiled (so the compiler sees the recomputation), then sharded.
"""
import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple, Type

import torch
from mmengine.logging import print_log
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from .compat import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_inner,
    checkpoint_wrapper,
    set_activation_memory_budget,
)
from .options import option_dict, suggest

__all__ = ['ActivationCheckpointing', 'RegionalCompile', 'apply_activation_checkpointing_to',
           'check_layer_options', 'prepare_layers', 'resolve_activation_checkpointing',
           'resolve_regional_compile']

AC_KEY = 'model_wrapper_cfg.activation_checkpointing'
COMPILE_KEY = 'model_wrapper_cfg.regional_compile'
CHECKPOINT_MODES = ('full', 'selective', 'memory_budget')

#: What ``mode='selective'`` keeps unless ``save_ops`` says otherwise: the
#: expensive ops (matrix products, convolutions, attention), as torchtitan does.
DEFAULT_SAVE_OPS = ('aten.mm', 'aten.addmm', 'aten.bmm', 'aten.baddbmm', 'aten.convolution',
                    'aten._scaled_dot_product_flash_attention',
                    'aten._scaled_dot_product_flash_attention_for_cpu',
                    'aten._scaled_dot_product_efficient_attention',
                    'aten._scaled_dot_product_cudnn_attention')


def _op(name: str) -> Optional[Any]:
    """The operator packet ``torch.ops.<namespace>.<op>`` for ``'namespace.op'``, or ``None``."""
    namespace, _, op = name.partition('.')
    try:
        return getattr(getattr(torch.ops, namespace), op) if op else None
    except (AttributeError, RuntimeError):
        return None


def _one_or_many(value: Any) -> Tuple[Any, ...]:
    """A class or name given alone, or a list of them, as a tuple."""
    return (value, ) if isinstance(value, (str, type)) else tuple(value)


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
    layer_cls = _one_or_many(cfg['layer_cls'])
    save_ops: Tuple[str, ...] = ()
    if mode == 'selective':
        given = cfg.get('save_ops')
        if given is None:
            save_ops = tuple(name for name in DEFAULT_SAVE_OPS if _op(name) is not None)
        else:
            save_ops = _one_or_many(given)
            unknown = [name for name in save_ops if not isinstance(name, str) or _op(name) is None]
            if unknown or not save_ops:
                raise ValueError(f'{AC_KEY}.save_ops: {unknown[0] if unknown else given!r} is '
                                 "not an operator; name operators as 'namespace.op', e.g. "
                                 f"{', '.join(map(repr, DEFAULT_SAVE_OPS[:5]))}")
    return ActivationCheckpointing(layer_cls=layer_cls, mode=mode, save_ops=save_ops)


@dataclass(frozen=True)
class RegionalCompile:
    """``regional_compile``, resolved: the layers compiled one by one, and how.

    Config::

        regional_compile=dict(layer_cls=['Block'])                      # torch.compile defaults
        regional_compile=dict(layer_cls=['Block'], fullgraph=True, mode='max-autotune')
    """

    layer_cls: Tuple[Any, ...] = ()
    #: Keyword arguments of ``torch.compile``.
    options: Mapping[str, Any] = field(default_factory=dict)


def resolve_regional_compile(value: Any) -> Optional[RegionalCompile]:
    """Resolve ``regional_compile``; torch checks the ``torch.compile`` arguments at start-up."""
    if value is None or isinstance(value, RegionalCompile):
        return value
    compile_args = [n for n in inspect.signature(torch.compile).parameters if n != 'model']
    cfg = option_dict(value, ['layer_cls'] + compile_args, COMPILE_KEY,
                      "None or dict(layer_cls=[...], **torch.compile's keyword arguments)")
    if not cfg.get('layer_cls'):
        raise TypeError(f"{COMPILE_KEY}: missing 'layer_cls', the layer classes to compile")
    layer_cls = _one_or_many(cfg['layer_cls'])
    # One static graph per layer shape: torch 2.13's automatic dynamic shapes, which a
    # second shape of a compiled layer turns on, fail inside inductor under FSDP2 (ResNet
    # stages; docs/benchmarks.md); dynamic=None / True asks for them.
    options = {'dynamic': False, **{k: v for k, v in cfg.items() if k != 'layer_cls'}}
    try:  # compiles nothing: torch checks backend, mode and options when the call is made
        torch.compile(lambda: None, **options)
    except Exception as e:
        raise ValueError(f'{COMPILE_KEY}: torch.compile refuses {options}: {e}') from e
    return RegionalCompile(layer_cls=layer_cls, options=options)


def check_layer_options(checkpointing: Optional[ActivationCheckpointing],
                        regional_compile: Optional[RegionalCompile]) -> None:
    """Raise on a combination the two options cannot honour together."""
    if checkpointing is not None and not checkpointing.wraps_layers and regional_compile is None:
        raise ValueError(f"{AC_KEY}: mode='memory_budget' acts through torch.compile's "
                         'partitioner and so needs compiled layers: add '
                         f"{COMPILE_KEY}=dict(layer_cls=[...]), or use mode='full' / "
                         "'selective' with layer_cls")


def layer_classes(option: Any, index: Any, key: str) -> Tuple[Type[nn.Module], ...]:
    """The classes an option's ``layer_cls`` names in the model of ``index`` (empty when off).

    ``index`` is the model's :class:`mmfsdp.policies.ModelIndex`.
    """
    if option is None or not option.layer_cls:
        return ()
    return index.classes_of(option.layer_cls, f'{key}.layer_cls')


def apply_activation_checkpointing_to(
        model: nn.Module, layer_cls: Tuple[Type[nn.Module], ...],
        checkpointing: Optional[ActivationCheckpointing] = None) -> None:
    """Wrap every ``layer_cls`` instance of ``model`` in a non-reentrant checkpoint of the mode."""
    if layer_cls:
        kwargs = checkpointing.checkpoint_kwargs() if checkpointing is not None else {}
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs),
            check_fn=lambda module: isinstance(module, layer_cls))


def prepare_layers(model: nn.Module, layout: Any) -> None:
    """Checkpoint, then compile, the layers ``layout`` names (before they are sharded).

    ``layout`` is a :class:`mmfsdp.wrappers.base.Layout`. A compiled layer that
    is checkpointed is compiled as its checkpoint wrapper; a layer inside
    another compiled layer is compiled as part of it.
    """
    apply_activation_checkpointing_to(model, layout.checkpoint_layers, layout.checkpointing)
    checkpointing = layout.checkpointing
    if checkpointing is not None and not checkpointing.wraps_layers:
        set_activation_memory_budget(checkpointing.memory_budget)
        print_log(f'{AC_KEY}: torch.compile keeps at most {checkpointing.memory_budget:g} of the '
                  'activations of the compiled layers (torch._functorch.config.'
                  'activation_memory_budget, set for this process)', logger='current',
                  level=logging.INFO)
    if not layout.compile_layers:
        return
    outer = {id(checkpoint_inner(m)): m for m in model.modules()
             if checkpoint_inner(m) is not None}
    compiled: list = []
    for name, module in model.named_modules():
        if isinstance(module, layout.compile_layers) and not any(
                name.startswith(f'{done}.') for done in compiled):
            outer.get(id(module), module).compile(**layout.regional_compile.options)
            compiled.append(name)

