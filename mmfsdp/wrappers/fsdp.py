"""``MMFullyShardedDataParallel``: torch's FSDP1 for mmengine models."""
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from ..activation_checkpointing import apply_activation_checkpointing_to
from ..dist import current_device
from ..meta_init import check_meta_model, materialize, set_preprocessor_device
from ..plan.spec import ShardingSpec
from ..policies import planned_policy
from ..registry import MODEL_WRAPPERS
from .config import FSDPConfig
from .configured import ConfiguredWrapper
from .grad_sync import AccumulationNoSync
from .guard import reject_stock_runner
from .mesh import build_hybrid_mesh
from .separate import MMSeparateFullyShardedDataParallel
from .specs import fsdp1_spec
from .steps import DataParallelSteps, own_steps

__all__ = ['FSDPConfig', 'MMFullyShardedDataParallel']


@MODEL_WRAPPERS.register_module()
class MMFullyShardedDataParallel(DataParallelSteps, AccumulationNoSync, FullyShardedDataParallel,
                                 ConfiguredWrapper):
    """Fully sharded data parallel (FSDP1) with mmengine's step interface.

    The keyword arguments are the fields of :class:`FSDPConfig`. The device is
    this process's accelerator or the CPU (chosen here, not configured).
    Parameters keep their names and objects (``use_orig_params=True``), which
    per-parameter optimizer settings (``paramwise_cfg``) rely on.

    Build it through :class:`mmfsdp.FSDPRunner`, which initialises weights on
    the full model before sharding, groups parameters by their unsharded
    shapes and clips by the global norm; mmengine's stock Runner is refused.

    The device never holds the full model: the model stays on the CPU until
    wrapping and FSDP moves it to the device unit by unit (``device_id``),
    with rank 0's weights broadcast per unit on the device. With
    ``init_device='meta'`` the model is built on the meta device and
    materialised on the CPU with the verified init of :mod:`mmfsdp.meta_init`.

    Config::

        runner_type = 'mmfsdp.FSDPRunner'
        model_wrapper_cfg = dict(
            type='mmfsdp.MMFullyShardedDataParallel',
            sharding_strategy='FULL_SHARD',        # any ShardingStrategy name
            auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
            backward_prefetch='pre',               # 'pre' | 'post' | None
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32'),
            cpu_offload=False,
            activation_checkpointing=dict(layer_cls=['TransformerBlock']),
            init_device=None,                      # 'meta': build without weights first
            accumulation='sharded')                # 'unsharded': no_sync, full gradients
    """

    #: :class:`mmfsdp.FSDPRunner` may build the model on the meta device for it.
    supports_meta_init = True
    CONFIG = FSDPConfig
    NAME = 'mmfsdp.MMFullyShardedDataParallel'

    def __new__(cls, module: Optional[nn.Module] = None, **config: Any) -> nn.Module:
        """A new wrapper; for a model with its own steps, one FSDP1 root per child.

        FSDP1 reduces gradients only after a backward through its root's
        forward, which a model's own ``train_step`` never runs (see
        :mod:`mmfsdp.wrappers.separate`).
        """
        if module is not None and own_steps(module) and cls is MMFullyShardedDataParallel:
            reject_stock_runner(cls.__name__)
            return MMSeparateFullyShardedDataParallel(module, **config)
        return super().__new__(cls)

    def __init__(self, module: nn.Module, **config: Any) -> None:
        reject_stock_runner(type(self).__name__)
        cfg = FSDPConfig.from_dict(config)
        device = current_device()
        cfg.check_device(device)
        policy, checkpoint_layers = cfg.for_model(module)
        on_meta = check_meta_model(module, cfg.init_device, 'before sharding')
        if on_meta:
            # On the CPU, then to the device unit by unit: FSDP1 flattens whole
            # tensors, so shape-dependent initialisers need them unsharded.
            materialize(module, torch.device('cpu'),
                        broadcast='all' if device.type == 'cpu' else None)
        # A 2-D mesh, not FSDP1's own intra-node groups: with it the sharded state
        # dicts are DTensors over the whole world, so a DCP save covers every rank
        # (without it they cover one node's group only, torch #102904).
        mesh = build_hybrid_mesh(device) if cfg.hybrid else None
        super().__init__(
            module,
            sharding_strategy=cfg.sharding_strategy,
            auto_wrap_policy=planned_policy(module, policy) if policy else None,
            backward_prefetch=cfg.backward_prefetch,
            mixed_precision=cfg.mixed_precision,
            cpu_offload=cfg.cpu_offload,
            device_id=device,
            device_mesh=mesh,
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=cfg.limit_all_gathers,
            # FSDP1 broadcasts only tensors on an accelerator; on the CPU materialize() did
            sync_module_states=cfg.sync_module_states or (on_meta and device.type != 'cpu'),
            use_orig_params=True)
        set_preprocessor_device(self.module, device)
        apply_activation_checkpointing_to(self, checkpoint_layers)
        self._accumulation = cfg.accumulation
        self._sync_next_backward = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """FSDP1's forward; its backward reduces gradients unless it ran in ``no_sync``."""
        # FSDP1 reads _sync_gradients in backward, which mmengine runs after leaving
        # no_sync (around the forward only); so set it here for the coming backward.
        for module in FullyShardedDataParallel.fsdp_modules(self):
            module._sync_gradients = self._sync_next_backward
        return super().forward(*args, **kwargs)

    @classmethod
    def stages_on_cpu(cls, config: Mapping[str, Any], device: torch.device) -> bool:
        """On an accelerator, unless ``sync_module_states=False``: FSDP1 broadcasts per unit.

        FSDP1's broadcast (``sync_module_states``) takes device tensors; on the
        CPU the runner's own broadcast serves.
        """
        return device.type != 'cpu' and config.get('sync_module_states') is not False

    @classmethod
    def sharding_spec(cls, config: Mapping[str, Any], module: nn.Module,
                      world_size: int) -> ShardingSpec:
        """How this config shards ``module`` over ``world_size`` ranks (see :mod:`mmfsdp.plan`).

        Hybrid strategies shard within a node of ``LOCAL_WORLD_SIZE`` ranks
        (the whole world when unset).
        """
        return fsdp1_spec(FSDPConfig.from_dict(config), module, world_size)
