"""``MMDistributedDataParallel``: torch's DDP for mmengine models, on any device."""
import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Iterator, List, Mapping, Optional, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..dist import teardown_at_exit
from ..options import check_keys
from ..policies import ModelIndex
from ..registry import MODEL_WRAPPERS
from .base import Layout, ParallelWrapper, WrapperConfig, own_steps, prepare_layers

NAME = 'mmfsdp.MMDistributedDataParallel'
#: Chosen by the wrapper, not configured.
_DERIVED = ('self', 'module', 'device_ids', 'output_device')
#: The options that are mmfsdp's (or mmengine's), not keywords of torch's DDP.
_OURS = ('detect_anomalous_params', 'activation_checkpointing', 'regional_compile')


@dataclass(frozen=True)
class DDPConfig(WrapperConfig):
    """The options of :class:`MMDistributedDataParallel`: DDP's keyword arguments, checked.

    mmengine's defaults (``broadcast_buffers=False``, ``gradient_as_bucket_view``
    as torch's) and its ``detect_anomalous_params``; mmfsdp's
    ``activation_checkpointing`` and ``regional_compile``; any other keyword
    of torch's ``DistributedDataParallel`` is passed on. The sharded wrappers'
    fields keep their defaults (no units, nothing kept in fp32).
    """

    #: Log parameters that took no part in the loss (mmengine's DDP option).
    detect_anomalous_params: bool = False
    #: Keyword arguments of torch's ``DistributedDataParallel``.
    ddp_kwargs: Mapping[str, Any] = field(default_factory=dict)

    NAME: ClassVar[str] = NAME

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> 'DDPConfig':
        """Check the keys against torch's DDP; ``broadcast_buffers`` becomes its new name.

        torch 2.13 deprecates ``broadcast_buffers`` for ``forward_sync_buffers``
        (warning on every job). ``forward_sync_buffers=False`` still broadcasts
        rank 0's buffers at construction, where ``broadcast_buffers=False`` did
        not; mmfsdp's runners broadcast rank 0's weights and buffers right
        before wrapping anyway, so the buffers that training starts from are
        the same.
        """
        if cfg.get('mixed_precision') is not None:  # torch's DDP takes a private dataclass
            raise ValueError(
                f"model_wrapper_cfg.mixed_precision={cfg['mixed_precision']!r}: "
                f'{NAME} keeps fp32 parameters and gradients. For mixed precision under DDP use '
                "optim_wrapper=dict(type='mmfsdp.AmpOptimWrapper', dtype='bfloat16') (autocast, "
                "as mmengine's AMP), or a sharded wrapper ('mmfsdp.MMFullyShard', "
                "'mmfsdp.MMFullyShardedDataParallel'), which take mixed_precision")
        valid = [n for n in inspect.signature(DistributedDataParallel.__init__).parameters
                 if n not in _DERIVED]
        check_keys(cfg, valid + list(_OURS), 'model_wrapper_cfg')
        kwargs = {k: v for k, v in cfg.items() if k not in _OURS and k != 'broadcast_buffers'}
        kwargs.setdefault('forward_sync_buffers', cfg.get('broadcast_buffers') or False)
        kwargs.setdefault('gradient_as_bucket_view', True)  # no second copy of the gradients
        return super().from_dict(dict({k: cfg[k] for k in _OURS if k in cfg}, ddp_kwargs=kwargs))

    def layout(self, index: Union[ModelIndex, nn.Module]) -> Layout:
        """The checkpointed and compiled layers (no units); an own ``train_step`` is refused.

        One DDP reduces only what flows through its forward, which a model's own step skips.
        """
        index = ModelIndex.of(index)
        if 'train_step' in own_steps(index.model):
            raise ValueError(
                f'model_wrapper_cfg.type={NAME!r}: {type(index.model).__name__} defines its own '
                'train_step, which calls its sub-modules directly, past the DDP forward that '
                "reduces gradients. Use model_wrapper_cfg=dict(type='MMSeparateDistributed"
                "DataParallel') (mmengine's DDP per child, as mmagic configs do), or "
                "'mmfsdp.MMFullyShard' / 'mmfsdp.MMFullyShardedDataParallel'")
        return Layout(**self._layers(index))


@MODEL_WRAPPERS.register_module()
class MMDistributedDataParallel(DistributedDataParallel, ParallelWrapper):
    """Distributed data parallel with mmengine's step interface, CPU included.

    Works under :class:`mmfsdp.FSDPRunner` and under mmengine's stock Runner,
    which passes ``device_ids=[LOCAL_RANK]``: the device is taken from the
    module instead (``None`` for a CPU module, which DDP requires). Every
    keyword of torch's DDP is accepted, and mmengine's ``detect_anomalous_params``.

    Config::

        model_wrapper_cfg = dict(
            type='mmfsdp.MMDistributedDataParallel',
            find_unused_parameters=False, static_graph=False,
            broadcast_buffers=False)               # as mmengine; forward_sync_buffers in torch
    """

    CONFIG = DDPConfig

    def __init__(self, module: nn.Module, device_ids: Optional[List[int]] = None, *,
                 config: Optional[DDPConfig] = None, layout: Optional[Layout] = None,
                 **options: Any) -> None:
        del device_ids
        cfg = config if config is not None else DDPConfig.from_dict(options)
        prepare_layers(module, layout or cfg.layout(ModelIndex(module)))
        device = next(module.parameters()).device
        super().__init__(module, device_ids=None if device.type == 'cpu' else [device.index],
                         **cfg.ddp_kwargs)
        self.detect_anomalous_params = cfg.detect_anomalous_params
        self._has_synced = False
        teardown_at_exit()  # also when mmengine's stock Runner built us: no abort at exit

    def train_step(self, data: Any, optim_wrapper: Any) -> Dict[str, torch.Tensor]:
        """One step of :class:`DataParallelSteps`, noting whether it synchronised."""
        log_vars = super().train_step(data, optim_wrapper)
        self._has_synced = self._has_synced or self.require_backward_grad_sync
        return log_vars

    def val_step(self, data: Any) -> list:
        """The module's own ``val_step``, as mmengine's DDP wrapper does.

        Every rank holds all parameters, and ``DDP.forward`` would make an
        evaluation batch a collective where ranks may see different numbers of batches.
        """
        return self.module.val_step(data)

    def test_step(self, data: Any) -> list:
        """The module's own ``test_step`` (see :meth:`val_step`)."""
        return self.module.test_step(data)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction, except before the first synchronised backward.

        DDP's static graph must record one synchronised backward first; skipping
        the reduction before that trips an assert in its reducer.
        """
        if self.static_graph and not self._has_synced:
            yield
            return
        with super().no_sync():
            yield
