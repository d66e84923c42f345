"""Regional compile: each layer of the named classes compiled on its own, before sharding.

``regional_compile=dict(layer_cls=['Block'], **torch.compile options)``
compiles each such layer with ``nn.Module.compile`` (``dynamic`` defaults to
``False``: one static graph per layer shape): repeated layers share one small
graph, compiled once, and the wrapper's collectives stay outside it. The names
of parameters and checkpoints do not change. ``compile=True`` at the top level
of a config keeps mmengine's meaning (the whole ``train_step``); the two are
not combined. The layers of one class share torch's limit of graphs
(``recompile_limit``): :func:`compile_layers` sets it per kind of layer and logs a
layer that reaches it. A checkpointed layer (:mod:`mmfsdp.checkpointing`) is compiled as
its checkpoint wrapper, so the compiler sees the recomputation.
"""
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from mmengine.logging import print_log
from torch import nn

from .compat import checkpoint_inner, default_recompile_limit, on_recompile_limit
from .options import one_or_many, option_dict
from .policies import within

COMPILE_KEY = 'model_wrapper_cfg.regional_compile'


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
    # One static graph per layer shape: on the CPU torch 2.13's inductor specialises a
    # convolution's height and width again (channels-last stride checks), with or without
    # FSDP2, so dynamic=None / True compile a graph per size all the same (and failed in
    # inductor on ResNet-50 stages under FSDP2, docs/benchmarks.md); mark_dynamic on a
    # layer's input is lost under FSDP2, whose pre-forward hands the layer a new view.
    options = {'dynamic': False, **{k: v for k, v in cfg.items() if k != 'layer_cls'}}
    try:  # compiles nothing: torch checks backend, mode and options when the call is made
        torch.compile(lambda: None, **options)
    except Exception as e:
        raise ValueError(f'{COMPILE_KEY}: torch.compile refuses {options}: {e}') from e
    return RegionalCompile(layer_cls=one_or_many(cfg['layer_cls']), options=options)


def _limit_reached(message: str) -> None:
    print_log(f'{COMPILE_KEY}: {message}\nThat layer now runs eager for inputs no graph fits: '
              'fewer input shapes (the pipeline padded to size_divisor buckets) or a larger '
              'recompile_limit keep it compiled', logger='current', level=logging.WARNING)


def compile_layers(model: nn.Module, classes: Tuple[type, ...], how: RegionalCompile,
                   wrappers: Dict[int, nn.Module]) -> None:
    """Compile each outermost layer of ``classes`` (as ``wrappers[id(layer)]`` where it has one).

    The layers compiled from one ``forward`` share its graphs and torch's limit on them
    (``recompile_limit``, a graph per input shape under ``dynamic=False``): unless the config
    gives it, the limit is torch's default once per distinct layer (class, parameter and
    buffer shapes), so a model with many kinds of layers gets as many graphs per kind as a
    model with one. Reaching it is logged as a warning; the layer then runs eager.
    """
    layers: Dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, classes) and not any(within(name, done) for done in layers):
            layers[name] = wrappers.get(id(module), module)
    kinds: Dict[type, set] = {}
    for layer in layers.values():
        inner = checkpoint_inner(layer) or layer
        tensors = inner.state_dict(keep_vars=True).items()
        kinds.setdefault(type(layer), set()).add(
            (type(inner), tuple((n, tuple(t.shape), t.requires_grad) for n, t in tensors)))
    on_recompile_limit(_limit_reached)
    for layer in layers.values():
        limit = default_recompile_limit() * len(kinds[type(layer)])
        layer.compile(**{'recompile_limit': limit, **how.options})
