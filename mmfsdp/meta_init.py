"""Meta-device initialisation: no rank ever holds the full model.

With ``init_device='meta'`` in the ``MMFullyShard`` config, :class:`mmfsdp.FSDPRunner`
builds the model under ``torch.device('meta')`` (shapes only, no storage),
wraps it at once, and the wrapper shards it and then :func:`materialize` s it:

1. every meta tensor is allocated empty on the device; parameters are
   DTensor shards by then, so each rank allocates only its shard;
2. every module's ``reset_parameters()`` runs (what construction would have
   done), then the model's ``init_weights()``, both on the sharded parameters;
3. buffers are broadcast from rank 0, so replicated state agrees.

The data preprocessor of an mmengine model is built normally, on the CPU
(:func:`build_on_meta`): its buffers (``mean`` / ``std``) are computed in its
constructor and nothing would recompute them. Any other buffer that a
constructor computes must be set again in ``reset_parameters()`` or
``init_weights()``; one left unset is an error (non-persistent) or a warning
(persistent: ``load_from`` may provide it).

Random initialisation on the CPU: DTensor draws each shard from the local
generator there, so every rank would draw the *same* numbers for *different*
shards. Each shard coordinate therefore draws from its own seed, derived
from rank 0's generator (replicas of a shard agree). Accelerators keep
DTensor's own RNG tracker.
"""
import contextlib
import logging
import math
import warnings
from typing import Any, Callable, Iterator, Mapping, Union

import torch
import torch.distributed as dist
from mmengine.logging import print_log
from mmengine.registry import MODELS
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ['build_on_meta', 'materialize', 'wants_meta_init']


def wants_meta_init(wrapper_cls: type, wrapper_cfg: Mapping[str, Any]) -> bool:
    """Whether the wrapper config asks for the model to be built on the meta device."""
    return (getattr(wrapper_cls, 'supports_meta_init', False)
            and wrapper_cfg.get('init_device') == 'meta')


def build_on_meta(build: Callable[[Any], nn.Module], model: Union[nn.Module, Mapping]
                  ) -> nn.Module:
    """``build(model)`` under ``torch.device('meta')``, its data preprocessor on the CPU."""
    if isinstance(model, nn.Module):
        raise TypeError("init_device='meta' needs the model as a config dict; a model passed "
                        'as an nn.Module is already built')
    model = dict(model)
    preprocessor = model.get('data_preprocessor')
    if isinstance(preprocessor, Mapping):
        model['data_preprocessor'] = MODELS.build(preprocessor)
    with torch.device('meta'):
        return build(model)


@contextlib.contextmanager
def _shard_seeded_rng(mesh: DeviceMesh, device: torch.device) -> Iterator[None]:
    """On the CPU, seed the global generator per shard coordinate; restore it afterwards."""
    handle = getattr(torch, device.type, None)
    if device.type != 'cpu' and hasattr(handle, 'set_rng_state'):
        yield  # DTensor's RNG tracker gives each shard its part of one stream
        return
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='DTensor random operators may not')
        base = torch.randint(0, 2**62, (1, ), dtype=torch.int64)
        dist.broadcast(base, src=0)
        coordinate = mesh.get_local_rank(mesh.ndim - 1)
        torch.manual_seed((int(base) * 1_000_003 + coordinate) % 2**63)
        yield


def materialize(model: nn.Module, device: torch.device, mesh: DeviceMesh) -> None:
    """Allocate and initialise the meta tensors of a sharded model (collective)."""
    from_meta = {name: buf.is_floating_point() for name, buf in model.named_buffers()
                 if buf.is_meta}
    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name in from_meta:
                buf.fill_(math.nan if from_meta[name] else 0)
    with _shard_seeded_rng(mesh, device):
        for module in model.modules():
            reset = getattr(module, 'reset_parameters', None)
            if callable(reset):
                reset()
        init_weights = getattr(model, 'init_weights', None)
        if callable(init_weights):
            init_weights()
    with torch.no_grad():
        for buf in model.buffers():
            dist.broadcast(buf, src=0)
    _check_buffers(model, [n for n, is_float in from_meta.items() if is_float])


def _check_buffers(model: nn.Module, names: list) -> None:
    """Raise or warn for meta-built buffers that no initialiser set (still NaN)."""
    buffers = dict(model.named_buffers())
    unset = [n for n in names if bool(torch.isnan(buffers[n]).all())]
    if not unset:
        return
    non_persistent = set()
    for module_name, module in model.named_modules():
        prefix = f'{module_name}.' if module_name else ''
        non_persistent.update(prefix + n for n in module._non_persistent_buffers_set)
    lost = [n for n in unset if n in non_persistent]
    how = ("under init_device='meta' a constructor's tensors are never computed; set these "
           "buffers in the module's reset_parameters() or the model's init_weights()")
    if lost:
        raise RuntimeError(f'buffers {lost} were built on the meta device and not initialised '
                           f'(they are not in checkpoints either): {how}')
    print_log(f'buffers {unset} were built on the meta device and not initialised; they hold '
              f'NaN unless load_from provides them: {how}', logger='current',
              level=logging.WARNING)
