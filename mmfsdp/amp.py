"""``AmpOptimWrapper``: mixed-precision training on any device, shard-aware loss scaling.

mmengine's wrapper asserts CUDA, and its scaler looks for inf/nan in the local
gradients only: under FSDP1 one rank could skip a step the others take. Here
autocast and the scaler follow the device, and FSDP1 gets ``ShardedGradScaler``.
Config (what ``tools/train.py --amp`` selects)::

    optim_wrapper = dict(type='mmfsdp.AmpOptimWrapper', dtype='float16',
                         optimizer=dict(type='AdamW', lr=1e-3))
"""
import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from mmengine.optim import AmpOptimWrapper as MMEngineAmpOptimWrapper
from mmengine.optim import OptimWrapper
from mmengine.registry import OPTIM_WRAPPERS as MMENGINE_OPTIM_WRAPPERS
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from .compat import init_without_amp_checks, set_fixed_loss_scale
from .dist import current_device
from .optim import ModelBinding
from .options import check_keys, resolve_dtype
from .registry import OPTIM_WRAPPERS

__all__ = ['AmpOptimWrapper', 'autocast_dtype', 'replace_stock_amp']

_SCALER_KEYS = ('init_scale', 'growth_factor', 'backoff_factor', 'growth_interval', 'enabled')
#: mmengine's dtype names (``float64`` among them), as its ``AmpOptimWrapper`` converts them.
_STOCK_DTYPES = {name: getattr(torch, name) for name in MMEngineAmpOptimWrapper.valid_dtypes}


@OPTIM_WRAPPERS.register_module()
class AmpOptimWrapper(MMEngineAmpOptimWrapper, ModelBinding):
    """mmengine's ``AmpOptimWrapper`` (same arguments), on CPU and accelerators.

    mmengine's asserts CUDA, and its scaler checks only the local gradients, so
    under FSDP1 ranks could disagree on skipping a step. Here autocast follows
    the device, and once the model is wrapped the scaler sees every rank's
    shard (FSDP1: torch's ``ShardedGradScaler``). ``FSDPRunner`` also builds it
    in place of mmengine's when ``tools/train.py --amp`` asks for that one.

    Config::

        optim_wrapper = dict(type='mmfsdp.AmpOptimWrapper', dtype='bfloat16',
                             optimizer=dict(type='AdamW', lr=1e-4))

    Args:
        loss_scale: ``'dynamic'``, a fixed scale, or a dict of ``GradScaler`` arguments.
        dtype: Autocast dtype: mmengine's names (default ``'float16'``), mmfsdp's
            aliases (``'bf16'`` ...) or a ``torch.dtype``.
        **kwargs: ``OptimWrapper`` arguments (``optimizer``, ``clip_grad`` ...).

    """

    def __init__(self,
                 loss_scale: Union[str, float, Dict[str, Any]] = 'dynamic',
                 dtype: Union[str, torch.dtype, None] = None,
                 **kwargs: Any) -> None:
        init_without_amp_checks(self, **kwargs)
        self.cast_dtype = _cast_dtype(dtype)
        self._device = current_device()
        set_fixed_loss_scale(self, None)
        if loss_scale == 'dynamic':
            self._scaler_kwargs: Dict[str, Any] = {}
        elif isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
            set_fixed_loss_scale(self, float(loss_scale))
            self._scaler_kwargs = dict(init_scale=float(loss_scale))
        elif isinstance(loss_scale, dict):
            check_keys(loss_scale, _SCALER_KEYS, 'optim_wrapper.loss_scale')
            self._scaler_kwargs = dict(loss_scale)
        else:
            raise TypeError("optim_wrapper.loss_scale: expected 'dynamic', a number or a dict "
                            f'of {list(_SCALER_KEYS)}, got {loss_scale!r}')
        self.loss_scaler = torch.amp.GradScaler(self._device.type, **self._scaler_kwargs)

    def bind_model(self, model: nn.Module) -> None:
        """After wrapping: with FSDP1 units, a ``ShardedGradScaler`` over the outermost's group."""
        unit = next((m for m in model.modules() if isinstance(m, FullyShardedDataParallel)), None)
        if unit is not None and not isinstance(self.loss_scaler, ShardedGradScaler):
            scaler = ShardedGradScaler(self._device.type, process_group=unit.process_group,
                                       **self._scaler_kwargs)
            scaler.load_state_dict(self.loss_scaler.state_dict())
            self.loss_scaler = scaler

    @contextlib.contextmanager
    def optim_context(self, model: nn.Module) -> Iterator[None]:
        """Gradient accumulation (``no_sync``) and autocast on this process's device."""
        with OptimWrapper.optim_context(self, model), torch.autocast(
                self._device.type, dtype=self.cast_dtype):
            yield


def _cast_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    """An autocast dtype: mmengine's names as it converts them ('float64' too), mmfsdp's aliases."""
    return ((isinstance(dtype, str) and _STOCK_DTYPES.get(dtype))
            or resolve_dtype(dtype, 'optim_wrapper.dtype') or torch.float16)


def _type_of(cfg: Mapping[str, Any]) -> Any:
    """``cfg['type']`` (an optim wrapper's; mmengine's default), looked up as mmengine would."""
    kind = cfg.get('type', 'OptimWrapper')
    if isinstance(kind, str):
        with MMENGINE_OPTIM_WRAPPERS.switch_scope_and_registry(cfg.get('_scope_')) as registry:
            kind = registry.get(kind)
    return kind


def autocast_dtype(optim_wrapper: Any) -> Optional[torch.dtype]:
    """The dtype the forward autocasts to under an ``optim_wrapper`` config (``None``: no AMP).

    mmengine's ``AmpOptimWrapper`` (``tools/train.py --amp``: float16) and mmfsdp's;
    the parameters keep their dtype. What the plan traces the step under.
    """
    if not isinstance(optim_wrapper, Mapping):
        return None
    kind = _type_of(optim_wrapper)
    amp = isinstance(kind, type) and issubclass(kind, MMEngineAmpOptimWrapper)
    return _cast_dtype(optim_wrapper.get('dtype')) if amp else None


def replace_stock_amp(optim_wrapper: Any) -> Tuple[Any, List[str]]:
    """A copy of ``optim_wrapper`` with mmengine's ``AmpOptimWrapper`` replaced; the keys replaced.

    Per-optimizer dicts are replaced too; ``use_fsdp`` is dropped.
    """
    if not isinstance(optim_wrapper, Mapping):
        return optim_wrapper, []
    if _type_of(optim_wrapper) is MMEngineAmpOptimWrapper:
        options = {k: v for k, v in optim_wrapper.items() if k not in ('use_fsdp', '_scope_')}
        return dict(options, type=AmpOptimWrapper), ['optim_wrapper.type']
    replaced = {name: replace_stock_amp(sub)[0] for name, sub in optim_wrapper.items()
                if isinstance(sub, Mapping) and _type_of(sub) is MMEngineAmpOptimWrapper}
    if not replaced:
        return optim_wrapper, []
    return dict(optim_wrapper, **replaced), [f'optim_wrapper.{name}.type' for name in replaced]
