"""``MMFullyShardedDataParallel``: torch's FSDP1 for mmengine models, and its config.

``MMSeparateFullyShardedDataParallel`` is its form for a model that runs its own
steps (a GAN, a TTA model): one FSDP1 root per child; the builder
(:mod:`mmfsdp.wrappers.builder`) picks it for such a model.
"""
import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)

from ..compat import HYBRID_SHARD_ZERO2, set_fsdp1_gradient_sync
from ..dist import current_device, local_world_size, teardown_at_exit
from ..layers import ActivationCheckpointing, RegionalCompile, prepare_layers
from ..meta_init import check_meta_model, materialize, set_preprocessor_device
from ..optim import clip_grads_by_global_norm
from ..options import (
    FP32_MODULES_DEFAULT,
    Accumulation,
    Fp32Modules,
    check_fp32_modules,
    move_fp32_modules,
    resolve_accumulation,
    resolve_backward_prefetch,
    resolve_cpu_offload,
    resolve_flag,
    resolve_init_device,
    resolve_mixed_precision,
    resolve_sharding_strategy,
)
from ..policies import PolicyConfig
from ..registry import MODEL_WRAPPERS
from .base import (
    AccumulationNoSync,
    Construction,
    DataParallelSteps,
    Layout,
    ModelHolder,
    Padding,
    ParallelWrapper,
    ShardingSpec,
    WrapperConfig,
    fp32_module_names,
    reject_stock_runner,
    resolved,
    units_children_first,
)

__all__ = ['FSDPConfig', 'MMFullyShardedDataParallel', 'MMSeparateFullyShardedDataParallel',
           'node_mesh_sizes']

NAME = 'mmfsdp.MMFullyShardedDataParallel'


def _flag(key: str) -> Any:
    return lambda value: resolve_flag(value, key=f'model_wrapper_cfg.{key}')


def node_mesh_sizes(world_size: int, local: Optional[int]) -> Tuple[int, int]:
    """``(replicate, shard)`` for sharding within each node of ``local`` ranks (``None``: one)."""
    shard = min(world_size, local or world_size)
    if world_size % shard:
        raise ValueError(f'LOCAL_WORLD_SIZE: {shard} ranks per node do not divide the world '
                         f'size {world_size}; hybrid sharding needs the same number of ranks '
                         'on every node')
    return world_size // shard, shard


def _hybrid_mesh(device: torch.device) -> DeviceMesh:
    """FSDP1's hybrid strategies on a 2-D mesh: shard within a node, replicate across.

    A mesh rather than FSDP1's own intra-node groups: the sharded state dicts
    are then DTensors over the whole world, so a DCP save covers every rank
    (torch #102904). Collective.
    """
    replicate, shard = node_mesh_sizes(dist.get_world_size(), local_world_size())
    return init_device_mesh(device.type, (replicate, shard), mesh_dim_names=('replicate', 'shard'))


@dataclass(frozen=True)
class FSDPConfig(WrapperConfig):
    """The configuration of :class:`MMFullyShardedDataParallel`, resolved."""

    #: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD, HYBRID_SHARD, ...
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    #: Which submodules become their own unit (see :mod:`mmfsdp.policies`).
    auto_wrap_policy: PolicyConfig = None
    #: When to fetch the next unit's parameters in backward.
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    #: Compute / reduce / buffer dtypes; ``None`` trains in the parameters' dtype.
    mixed_precision: Optional[MixedPrecision] = None
    #: Keep sharded parameters and gradients on the CPU (accelerators only).
    cpu_offload: CPUOffload = field(default_factory=CPUOffload)
    #: ``dict(layer_cls=[...], mode=...)``: layers whose activations are
    #: recomputed in backward (:mod:`mmfsdp.layers`).
    activation_checkpointing: Optional[ActivationCheckpointing] = None
    #: ``dict(layer_cls=[...], **torch.compile options)``: layers compiled one by one.
    regional_compile: Optional[RegionalCompile] = None
    #: Fetch the next unit's parameters during forward, ahead of its use.
    forward_prefetch: bool = False
    #: Bound the number of all-gathers in flight (caps memory on accelerators).
    limit_all_gathers: bool = True
    #: Broadcast rank 0's weights at construction, unit by unit on the device.
    #: ``None``: FSDPRunner decides (on where it keeps the model on the CPU until wrapping).
    sync_module_states: Optional[bool] = None
    #: ``'meta'``: build on the meta device, materialise on the CPU, then shard.
    init_device: Optional[str] = None
    #: ``'sharded'`` reduce-scatters every micro-step, ``'unsharded'`` keeps full
    #: local gradients until the last (see :mod:`mmfsdp.options`).
    accumulation: Accumulation = Accumulation.SHARDED
    #: ``mixed_precision.fp32_modules``: module classes (or their names) that
    #: compute in fp32 under a lower ``param_dtype``; FSDP1's
    #: ``MixedPrecision._module_classes_to_ignore``, each instance its own unit.
    fp32_modules: Fp32Modules = FP32_MODULES_DEFAULT

    NAME: ClassVar[str] = NAME
    trainable_roots_only: ClassVar[bool] = True
    RESOLVERS: ClassVar[Mapping[str, Any]] = dict(
        sharding_strategy=resolve_sharding_strategy,
        backward_prefetch=resolve_backward_prefetch,
        mixed_precision=resolve_mixed_precision,
        cpu_offload=resolve_cpu_offload,
        forward_prefetch=_flag('forward_prefetch'),
        limit_all_gathers=_flag('limit_all_gathers'),
        sync_module_states=lambda v: None if v is None else resolve_flag(
            v, key='model_wrapper_cfg.sync_module_states'),
        init_device=resolve_init_device,
        accumulation=lambda value: _fsdp1_accumulation(resolve_accumulation(value)),
        fp32_modules=check_fp32_modules,
    )

    @classmethod
    def _translate(cls, cfg: Dict[str, Any]) -> Dict[str, Any]:
        return move_fp32_modules(cfg)

    def _fp32_modules(self, module: nn.Module) -> Tuple[str, ...]:
        mp = self.mixed_precision
        return fp32_module_names(module, self.fp32_modules, mp.param_dtype if mp else None)

    @property
    def offloads_to_cpu(self) -> bool:
        """``cpu_offload``."""
        return self.cpu_offload.offload_params

    @property
    def hybrid(self) -> bool:
        """Whether the strategy replicates across nodes and shards within each."""
        return self.sharding_strategy in (ShardingStrategy.HYBRID_SHARD, HYBRID_SHARD_ZERO2)

    def stages_on_cpu(self, device: torch.device) -> bool:
        """On an accelerator, unless ``sync_module_states=False`` was written.

        FSDP1 then moves the model and broadcasts rank 0's weights unit by unit,
        so no device holds it whole.
        """
        return device.type != 'cpu' and self.sync_module_states is not False

    def check_device(self, device: torch.device) -> None:
        """FSDP1 offloads into pinned memory, which needs an accelerator."""
        if self.cpu_offload.offload_params and device.type == 'cpu':
            raise ValueError('model_wrapper_cfg.cpu_offload: FSDP1 offloads to pinned memory, '
                             'which needs an accelerator, and this process trains on the CPU; '
                             'set cpu_offload=False (the parameters are on the CPU already)')

    def sharding_spec(self, layout: Layout, world_size: int) -> ShardingSpec:
        """Hybrid strategies shard within a node of ``LOCAL_WORLD_SIZE`` ranks (all, unset)."""
        strategy = self.sharding_strategy
        shard = world_size
        if strategy is ShardingStrategy.NO_SHARD:
            shard = 1
        elif self.hybrid:
            shard = node_mesh_sizes(world_size, local_world_size())[1]
        sharded = shard > 1
        return ShardingSpec(
            wrapper=NAME, strategy=strategy.name,
            shard_size=shard, replicate_size=world_size // shard,
            units=units_children_first(layout.units, layout.fp32_modules),
            fp32_units=layout.fp32_modules,
            padding=Padding.FLAT if sharded else Padding.NONE,
            shard_params=sharded, shard_grads=sharded, shard_optimizer=sharded,
            keep_gathered_until_backward=sharded and strategy in (
                ShardingStrategy.SHARD_GRAD_OP, HYBRID_SHARD_ZERO2),
            compute_dtype=self.mixed_precision.param_dtype if self.mixed_precision else None,
            construction=Construction.UNIT_BY_UNIT, grads_freed_between_steps=True,
            checkpoint_layers=layout.checkpoint_layers,
            unsharded_accumulation=self.accumulation is Accumulation.UNSHARDED)


def _planned_policy(module: nn.Module, units: Tuple[str, ...]) -> Any:
    """FSDP1's ``auto_wrap_policy`` that wraps exactly the planned units (no second walk)."""
    ids = frozenset(id(module.get_submodule(name)) for name in units)
    return lambda module, recurse, nonwrapped_numel: recurse or id(module) in ids


def _fsdp1_accumulation(value: Accumulation) -> Accumulation:
    """FSDP1 has no switch that reduce-scatters without the all-reduce across replicas."""
    if value is Accumulation.HYBRID:
        raise ValueError("model_wrapper_cfg.accumulation='hybrid': torch's FSDP1 cannot "
                         'reduce-scatter within a node while skipping the all-reduce across '
                         "nodes (no_sync skips both); use type='mmfsdp.MMFullyShard' with "
                         "mesh=dict(replicate=..., shard=...), or accumulation='unsharded' / "
                         "'sharded'")
    return value


def _with_classes(option: Any, classes: Tuple[type, ...]) -> Any:
    """``option`` (a layer option of :mod:`mmfsdp.layers`) naming ``classes`` instead of names."""
    return option if option is None or not option.layer_cls else replace(option, layer_cls=classes)


def _fp32_classes(module: nn.Module, layout: Layout) -> Tuple[type, ...]:
    """The classes of the layout's modules kept in fp32 (FSDP1 takes classes)."""
    return tuple(dict.fromkeys(type(module.get_submodule(n)) for n in layout.fp32_modules))


def _keep_in_fp32(module: nn.Module, layout: Layout, mixed_precision: Optional[MixedPrecision]
                  ) -> Tuple[Optional[MixedPrecision], Any]:
    """FSDP1's mixed precision and auto-wrap policy that keep ``layout.fp32_modules`` in fp32.

    FSDP1 keeps ``_module_classes_to_ignore`` in full precision only through an
    ``auto_wrap_policy`` (it wraps each instance separately); without units a
    policy that wraps nothing else is given, so that it still does.
    """
    policy = _planned_policy(module, layout.units) if layout.units else None
    if mixed_precision is None:
        return None, policy
    classes = _fp32_classes(module, layout)
    # why: FSDP1 names the field privately (experimental) in its public dataclass
    mixed_precision = replace(mixed_precision, _module_classes_to_ignore=classes)
    return mixed_precision, policy or (_planned_policy(module, ()) if classes else None)


@MODEL_WRAPPERS.register_module()
class MMFullyShardedDataParallel(DataParallelSteps, AccumulationNoSync, FullyShardedDataParallel,
                                 ParallelWrapper):
    """Fully sharded data parallel (FSDP1) with mmengine's step interface.

    The keyword arguments are the fields of :class:`FSDPConfig`; the device is
    this process's accelerator or the CPU. Parameters keep their names and
    objects (``use_orig_params=True``), which ``paramwise_cfg`` relies on.
    Build it through :class:`mmfsdp.FSDPRunner`; mmengine's stock Runner is
    refused.

    Config::

        runner_type = 'mmfsdp.FSDPRunner'
        model_wrapper_cfg = dict(
            type='mmfsdp.MMFullyShardedDataParallel',
            sharding_strategy='FULL_SHARD',        # any ShardingStrategy name
            auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']),
            backward_prefetch='pre',               # 'pre' | 'post' | None
            mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32',
                                 fp32_modules=['_BatchNorm']),  # the default; [] off
            activation_checkpointing=dict(layer_cls=['TransformerBlock']),
            init_device=None,                      # 'meta': build without weights first
            accumulation='sharded')                # 'unsharded': no_sync, full gradients
    """

    supports_meta_init = True
    CONFIG = FSDPConfig

    def __init__(self, module: nn.Module, *, config: Optional[FSDPConfig] = None,
                 layout: Optional[Layout] = None, **options: Any) -> None:
        reject_stock_runner(type(self).__name__)
        cfg = resolved(FSDPConfig, config, options)
        device = current_device()
        cfg.check_device(device)
        layout = layout or cfg.layout(module)
        if layout.roots is not None:
            raise ValueError(f'{type(module).__name__} runs its own steps: build '
                             'MMSeparateFullyShardedDataParallel (FSDPRunner does) so that each '
                             'child is an FSDP1 root of its own')
        on_meta = check_meta_model(module, cfg.init_device, 'before sharding')
        if on_meta:
            # On the CPU, then to the device unit by unit: FSDP1 flattens whole
            # tensors, so shape-dependent initialisers need them unsharded.
            materialize(module, torch.device('cpu'),
                        broadcast='all' if device.type == 'cpu' else None)
        mixed_precision, auto_wrap_policy = _keep_in_fp32(module, layout, cfg.mixed_precision)
        super().__init__(
            module,
            sharding_strategy=cfg.sharding_strategy,
            auto_wrap_policy=auto_wrap_policy,
            backward_prefetch=cfg.backward_prefetch,
            mixed_precision=mixed_precision,
            cpu_offload=cfg.cpu_offload,
            device_id=device,
            device_mesh=_hybrid_mesh(device) if cfg.hybrid else None,
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=cfg.limit_all_gathers,
            # FSDP1 broadcasts only tensors on an accelerator; on the CPU materialize() did
            sync_module_states=bool(cfg.sync_module_states) or (on_meta and device.type != 'cpu'),
            use_orig_params=True)
        set_preprocessor_device(self.module, device)
        prepare_layers(self, layout)  # inside the units: FSDP1's hooks stay outside compiled code
        self._accumulation = cfg.accumulation
        teardown_at_exit()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """FSDP1's forward; its backward reduces gradients unless it ran in ``no_sync``.

        FSDP1 reads its sync flag in backward, which mmengine runs after leaving
        ``no_sync``; so the flag is set here for the coming backward.
        """
        for module in FullyShardedDataParallel.fsdp_modules(self):
            set_fsdp1_gradient_sync(module, self._sync_next_backward)
        return super().forward(*args, **kwargs)


@MODEL_WRAPPERS.register_module()
class MMSeparateFullyShardedDataParallel(DataParallelSteps, ModelHolder, ParallelWrapper):
    """FSDP1 for a model with its own steps: each child with trainable parameters is a root.

    The model calls its children directly, past any wrapper's forward, and FSDP1
    gathers and reduces only through a root's forward; so each such child
    becomes an :class:`MMFullyShardedDataParallel` (the options apply to each).
    Children whose parameters are all frozen (an EMA copy) stay as they are,
    as under mmengine's ``MMSeparateDistributedDataParallel``.

    Config (the same as for any model; FSDPRunner picks this form)::

        model_wrapper_cfg = dict(type='mmfsdp.MMFullyShardedDataParallel')
    """

    supports_meta_init = True
    CONFIG = FSDPConfig

    def __init__(self, module: nn.Module, *, config: Optional[FSDPConfig] = None,
                 layout: Optional[Layout] = None, **options: Any) -> None:
        reject_stock_runner(type(self).__name__)
        super().__init__()
        cfg = resolved(FSDPConfig, config, options)
        device = current_device()
        layout = layout or cfg.layout(module)
        if check_meta_model(module, cfg.init_device, 'before sharding'):
            # The whole model on the device, so that its own init_weights and the
            # buffers it holds itself are materialised too (no staging: own steps).
            materialize(module, device, broadcast='all')
            cfg = replace(cfg, init_device=None)
        # The children resolve no names: the classes the whole model resolved them to.
        cfg = replace(cfg, fp32_modules=_fp32_classes(module, layout),
                      activation_checkpointing=_with_classes(cfg.activation_checkpointing,
                                                             layout.checkpoint_layers),
                      regional_compile=_with_classes(cfg.regional_compile,
                                                     layout.compile_layers))
        for name in layout.roots:
            child = module.get_submodule(name)
            module.register_module(name, MMFullyShardedDataParallel(child, config=cfg))
        set_preprocessor_device(module, device)
        self.module = module

    def roots(self) -> List[MMFullyShardedDataParallel]:
        """The FSDP1 roots, one per child with trainable parameters."""
        return [m for m in self.module.children() if isinstance(m, MMFullyShardedDataParallel)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward; its children gather their own parameters."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Every root's ``no_sync``."""
        with contextlib.ExitStack() as stack:
            for root in self.roots():
                stack.enter_context(root.no_sync())
            yield

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all roots' gradients by their global norm."""
        return clip_grads_by_global_norm(self, self.parameters(), max_norm, norm_type)
