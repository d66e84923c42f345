"""Regional compile: each layer of the named classes compiled on its own, before sharding.

``regional_compile=dict(layer_cls=['Block'], **torch.compile options)``
compiles each such layer with ``nn.Module.compile`` (``dynamic`` defaults to
``False``: one static graph per layer shape): repeated layers share one small
graph, compiled once, and the wrapper's collectives stay outside it. The names
of parameters and checkpoints do not change. ``compile=True`` at the top level
of a config keeps mmengine's meaning (the whole ``train_step``); the two are
not combined. A checkpointed layer (:mod:`mmfsdp.checkpointing`) is compiled as
its checkpoint wrapper, so the compiler sees the recomputation.
"""
import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple

import torch

from .options import one_or_many, option_dict

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
    # One static graph per layer shape: torch 2.13's automatic dynamic shapes, which a
    # second shape of a compiled layer turns on, fail inside inductor under FSDP2 (ResNet
    # stages; docs/benchmarks.md); dynamic=None / True asks for them.
    options = {'dynamic': False, **{k: v for k, v in cfg.items() if k != 'layer_cls'}}
    try:  # compiles nothing: torch checks backend, mode and options when the call is made
        torch.compile(lambda: None, **options)
    except Exception as e:
        raise ValueError(f'{COMPILE_KEY}: torch.compile refuses {options}: {e}') from e
    return RegionalCompile(layer_cls=one_or_many(cfg['layer_cls']), options=options)
