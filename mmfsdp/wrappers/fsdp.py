"""``MMFullyShardedDataParallel``: torch's FSDP1 for mmengine models, its config and options.

``MMSeparateFullyShardedDataParallel`` is its form for a model that runs its own
steps (a GAN, a TTA model): one FSDP1 root per child, each given its slice of
the model's layout; :meth:`MMFullyShardedDataParallel.wrap` picks it for such a model.
"""
import contextlib
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Iterator, List, Mapping, Optional, Tuple, Union

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

from ..compat import HYBRID_SHARD_ZERO2, set_fsdp1_gradient_sync, with_fsdp1_fp32_classes
from ..dist import current_device, local_world_size, teardown_at_exit
from ..layers import ActivationCheckpointing, RegionalCompile, prepare_layers
from ..meta_init import check_meta_model, materialize, set_preprocessor_device
from ..options import (
    FP32_MODULES_DEFAULT,
    Accumulation,
    Fp32Modules,
    check_fp32_modules,
    option_dict,
    resolve_accumulation,
    resolve_dtypes_and_flags,
    resolve_enum,
    resolve_flag,
    resolve_init_device,
    split_fp32_modules,
)
from ..policies import PolicyConfig
from ..registry import MODEL_WRAPPERS
from .base import (
    Construction,
    Layout,
    ModelHolder,
    Padding,
    ParallelWrapper,
    ShardingSpec,
    WrapperConfig,
    refuse_keyword_build,
    units_children_first,
)

__all__ = ['FSDPConfig', 'MMFullyShardedDataParallel', 'MMSeparateFullyShardedDataParallel',
           'node_mesh_sizes', 'resolve_backward_prefetch', 'resolve_cpu_offload',
           'resolve_mixed_precision', 'resolve_sharding_strategy']

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


_FSDP1_MP_DTYPES = ('param_dtype', 'reduce_dtype', 'buffer_dtype')
_FSDP1_MP_FLAGS = ('keep_low_precision_grads', 'cast_forward_inputs', 'cast_root_forward_inputs')
_MP_KEY = 'model_wrapper_cfg.mixed_precision'


def resolve_sharding_strategy(value: Union[str, ShardingStrategy]) -> ShardingStrategy:
    """``sharding_strategy``: any ``ShardingStrategy`` name, case-insensitive."""
    return resolve_enum(value, ShardingStrategy, 'model_wrapper_cfg.sharding_strategy')


def resolve_backward_prefetch(
        value: Union[str, BackwardPrefetch, None]) -> Optional[BackwardPrefetch]:
    """``backward_prefetch``: ``'pre' | 'post' | None`` or a ``BackwardPrefetch``."""
    if value is None:
        return None
    return resolve_enum(value, BackwardPrefetch, 'model_wrapper_cfg.backward_prefetch',
                        {'pre': BackwardPrefetch.BACKWARD_PRE,
                         'post': BackwardPrefetch.BACKWARD_POST})


def resolve_mixed_precision(
        value: Union[Mapping[str, Any], MixedPrecision, None]) -> Optional[MixedPrecision]:
    """``mixed_precision``: a dict of FSDP1 ``MixedPrecision`` fields, or one.

    ``mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32')``;
    its ``fp32_modules`` key is checked by :func:`check_fp32_modules`, not here.
    """
    if value is None or isinstance(value, MixedPrecision):
        return value
    option_dict(value, _FSDP1_MP_DTYPES + _FSDP1_MP_FLAGS + ('fp32_modules', ), _MP_KEY,
                'a dict, a MixedPrecision or None')
    value, _ = split_fp32_modules(value)  # resolved against the model (the config's layout)
    return MixedPrecision(
        **resolve_dtypes_and_flags(value, _FSDP1_MP_DTYPES, _FSDP1_MP_FLAGS, _MP_KEY))


def resolve_cpu_offload(value: Union[bool, Mapping[str, Any], CPUOffload]) -> CPUOffload:
    """``cpu_offload``: ``bool``, ``dict(offload_params=...)`` or a ``CPUOffload``."""
    if isinstance(value, CPUOffload):
        return value
    if isinstance(value, bool):
        return CPUOffload(offload_params=value)
    option_dict(value, ('offload_params', ), 'model_wrapper_cfg.cpu_offload',
                'True/False, dict(offload_params=...) or a CPUOffload')
    return CPUOffload(offload_params=resolve_flag(
        value.get('offload_params', False), 'model_wrapper_cfg.cpu_offload.offload_params'))


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

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """``mixed_precision.param_dtype``."""
        return self.mixed_precision.param_dtype if self.mixed_precision else None

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
            compute_dtype=self.compute_dtype,
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
    classes = tuple(dict.fromkeys(type(module.get_submodule(n)) for n in layout.fp32_modules))
    mixed_precision = with_fsdp1_fp32_classes(mixed_precision, classes)
    return mixed_precision, policy or (_planned_policy(module, ()) if classes else None)


@MODEL_WRAPPERS.register_module()
class MMFullyShardedDataParallel(FullyShardedDataParallel, ParallelWrapper):
    """Fully sharded data parallel (FSDP1) with mmengine's step interface.

    The keyword arguments are the fields of :class:`FSDPConfig`; the device is
    this process's accelerator or the CPU. Parameters keep their names and
    objects (``use_orig_params=True``), which ``paramwise_cfg`` relies on.
    Build it through :class:`mmfsdp.FSDPRunner` (mmengine's stock Runner is
    refused), or by hand with ``MMFullyShardedDataParallel.from_options(model, **options)``.

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
    no_sync = ParallelWrapper.no_sync  # model_wrapper_cfg.accumulation, not FSDP1's own

    @classmethod
    def wrap(cls, module: nn.Module, config: FSDPConfig, layout: Layout) -> nn.Module:
        """The wrapper of ``config``; for a model with its own steps, one FSDP1 root per child."""
        if layout.roots is not None:
            return MMSeparateFullyShardedDataParallel(module, config=config, layout=layout)
        return cls(module, config=config, layout=layout)

    def __init__(self, module: nn.Module, *, config: Optional[FSDPConfig] = None,
                 layout: Optional[Layout] = None, **options: Any) -> None:
        refuse_keyword_build(type(self), config, layout, options)
        cfg = config
        device = current_device()
        if layout.roots is not None:
            raise ValueError(f'{type(module).__name__} runs its own steps: build it with '
                             'MMFullyShardedDataParallel.wrap (FSDPRunner does) so that each '
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
class MMSeparateFullyShardedDataParallel(ModelHolder):
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
        refuse_keyword_build(type(self), config, layout, options)
        super().__init__()
        cfg = config
        device = current_device()
        if check_meta_model(module, cfg.init_device, 'before sharding'):
            # The whole model on the device, so that its own init_weights and the
            # buffers it holds itself are materialised too (no staging: own steps).
            materialize(module, device, broadcast='all')
            cfg = replace(cfg, init_device=None)
        for name in layout.roots:  # each root its slice of the model's layout: no second walk
            child = MMFullyShardedDataParallel(module.get_submodule(name), config=cfg,
                                               layout=layout.slice(name))
            module.register_module(name, child)
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
