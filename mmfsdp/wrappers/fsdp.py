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
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)

from .. import options
from ..compat import HYBRID_SHARD_ZERO2, set_fsdp1_gradient_sync, with_fsdp1_fp32_classes
from ..dist import current_device, local_world_size, teardown_at_exit
from ..meta_init import check_meta_model, materialize, set_preprocessor_device
from ..options import Accumulation
from ..policies import ModelIndex
from ..registry import MODEL_WRAPPERS
from . import base
from .base import Layout, ModelHolder, ParallelWrapper, WrapperConfig

NAME = 'mmfsdp.MMFullyShardedDataParallel'
#: FSDP1's hybrid strategies: shard within a node, replicate across nodes.
_HYBRID = base.MeshSpec(replicate=-1, shard=base.NODE)
_FSDP1_MP_DTYPES = ('param_dtype', 'reduce_dtype', 'buffer_dtype')
_FSDP1_MP_FLAGS = ('keep_low_precision_grads', 'cast_forward_inputs', 'cast_root_forward_inputs')


def resolve_backward_prefetch(
        value: Union[str, BackwardPrefetch, None]) -> Optional[BackwardPrefetch]:
    """``backward_prefetch``: ``'pre' | 'post' | None`` or a ``BackwardPrefetch``."""
    if value is None:
        return None
    return options.resolve_enum(value, BackwardPrefetch, 'model_wrapper_cfg.backward_prefetch',
                                {'pre': BackwardPrefetch.BACKWARD_PRE,
                                 'post': BackwardPrefetch.BACKWARD_POST})


def resolve_mixed_precision(
        value: Union[Mapping[str, Any], MixedPrecision, None]) -> Optional[MixedPrecision]:
    """``mixed_precision``: a dict of FSDP1 ``MixedPrecision`` fields, or one.

    ``mixed_precision=dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32')``;
    its ``fp32_modules`` key is moved out before (the config's ``fp32_modules``).
    """
    if value is None or isinstance(value, MixedPrecision):
        return value
    key = 'model_wrapper_cfg.mixed_precision'
    options.option_dict(value, _FSDP1_MP_DTYPES + _FSDP1_MP_FLAGS + ('fp32_modules', ), key,
                        'a dict, a MixedPrecision or None')
    return MixedPrecision(**options.resolve_dtypes_and_flags(value, _FSDP1_MP_DTYPES,
                                                             _FSDP1_MP_FLAGS, key))


def resolve_cpu_offload(value: Union[bool, Mapping[str, Any], CPUOffload]) -> CPUOffload:
    """``cpu_offload``: ``bool``, ``dict(offload_params=...)`` or a ``CPUOffload``."""
    if isinstance(value, CPUOffload):
        return value
    if isinstance(value, bool):
        return CPUOffload(offload_params=value)
    options.option_dict(value, ('offload_params', ), 'model_wrapper_cfg.cpu_offload',
                        'True/False, dict(offload_params=...) or a CPUOffload')
    return CPUOffload(offload_params=options.resolve_flag(
        value.get('offload_params', False), 'model_wrapper_cfg.cpu_offload.offload_params'))


@dataclass(frozen=True)
class FSDPConfig(WrapperConfig):
    """The configuration of :class:`MMFullyShardedDataParallel`, resolved."""

    #: FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), NO_SHARD, HYBRID_SHARD, ...
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    #: When to fetch the next unit's parameters in backward.
    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    #: Compute / reduce / buffer dtypes; ``None`` trains in the parameters' dtype.
    mixed_precision: Optional[MixedPrecision] = None
    #: Keep sharded parameters and gradients on the CPU (accelerators only).
    cpu_offload: CPUOffload = field(default_factory=CPUOffload)
    #: Fetch the next unit's parameters during forward, ahead of its use.
    forward_prefetch: bool = False
    #: Bound the number of all-gathers in flight (caps memory on accelerators).
    limit_all_gathers: bool = True
    #: Broadcast rank 0's weights at construction, unit by unit on the device.
    #: ``None``: FSDPRunner decides (on where it keeps the model on the CPU until wrapping).
    sync_module_states: Optional[bool] = None

    NAME: ClassVar[str] = NAME
    trainable_roots_only: ClassVar[bool] = True
    collective_forward: ClassVar[bool] = True
    shapes_kept: ClassVar[bool] = False
    RESOLVERS: ClassVar[Mapping[str, Any]] = dict(
        backward_prefetch=resolve_backward_prefetch, mixed_precision=resolve_mixed_precision,
        cpu_offload=resolve_cpu_offload)

    def __post_init__(self) -> None:
        """FSDP1 has no switch that reduce-scatters without the all-reduce across replicas."""
        super().__post_init__()
        if self.accumulation is Accumulation.HYBRID:
            raise ValueError("model_wrapper_cfg.accumulation='hybrid': torch's FSDP1 cannot "
                             'reduce-scatter within a node while skipping the all-reduce across '
                             "nodes (no_sync skips both); use type='mmfsdp.MMFullyShard' with "
                             "mesh=dict(replicate=..., shard=...), or accumulation='unsharded' / "
                             "'sharded'")

    def layout(self, index: Union[ModelIndex, nn.Module]) -> Layout:
        """The base layout, refused where torch's FSDP1 fails in the first backward.

        ``NO_SHARD`` with a ``param_dtype`` below fp32 and ``accumulation='unsharded'``
        assigns a low-precision gradient to the fp32 parameter of a tensor the model
        uses twice (tied embeddings): 'attempting to assign a gradient with dtype
        BFloat16 to a tensor with grad_dtype Float' (torch 2.13).
        """
        index = ModelIndex.of(index)
        tied = next((regs for regs in index.registrations.values() if len(regs) > 1), None)
        if (tied and self.low_precision and self.accumulation is Accumulation.UNSHARDED
                and self.sharding_strategy is ShardingStrategy.NO_SHARD):
            raise ValueError(
                "model_wrapper_cfg.accumulation='unsharded' with sharding_strategy='NO_SHARD' "
                f'and mixed_precision.param_dtype={self.compute_dtype}: '
                f'{type(index.model).__name__} shares {" = ".join(n for n, _ in tied)}, and '
                "torch's FSDP1 then fails in the "
                "backward (a low-precision gradient assigned to the fp32 parameter). Use "
                "accumulation='sharded' (NO_SHARD then all-reduces every micro-step), or "
                "type='mmfsdp.MMDistributedDataParallel' with "
                "optim_wrapper=dict(type='mmfsdp.AmpOptimWrapper', dtype='bfloat16')")
        return super().layout(index)

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



def _keep_in_fp32(module: nn.Module, layout: Layout, mixed_precision: Optional[MixedPrecision]
                  ) -> Tuple[Optional[MixedPrecision], Any]:
    """FSDP1's mixed precision and an ``auto_wrap_policy`` that wraps exactly the planned units.

    FSDP1 keeps ``_module_classes_to_ignore`` (here ``layout.fp32_modules``) in
    full precision only through an ``auto_wrap_policy`` (it wraps each instance
    separately); without units a policy that wraps nothing else is given, so
    that it still does.
    """
    classes = tuple(dict.fromkeys(type(module.get_submodule(n)) for n in layout.fp32_modules))
    if mixed_precision is not None:
        mixed_precision = with_fsdp1_fp32_classes(mixed_precision, classes)
    ids = frozenset(id(module.get_submodule(name)) for name in layout.units)

    def planned(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return recurse or id(module) in ids

    return mixed_precision, planned if layout.units or classes else None


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

    shards_parameters = True

    def gather_root(self, stack: contextlib.ExitStack) -> None:
        """Gather the root's own flat parameter (units gather theirs in their forward)."""
        stack.enter_context(FullyShardedDataParallel.summon_full_params(self, recurse=False))

    @classmethod
    def wrap(cls, module: nn.Module, config: FSDPConfig, layout: Layout) -> nn.Module:
        """The wrapper of ``config``; for a model with its own steps, one FSDP1 root per child."""
        if layout.roots is not None:
            return MMSeparateFullyShardedDataParallel(module, config=config, layout=layout)
        return cls(module, config=config, layout=layout)

    def __init__(self, module: nn.Module, *, config: Optional[FSDPConfig] = None,
                 layout: Optional[Layout] = None, **options: Any) -> None:
        base.refuse_keyword_build(type(self), config, layout, options)
        cfg = config
        device = current_device()
        if layout.roots is not None:
            raise ValueError(f'{type(module).__name__} runs its own steps: build it with '
                             'MMFullyShardedDataParallel.wrap (FSDPRunner does) so that each '
                             'child is an FSDP1 root of its own')
        on_meta = check_meta_model(module, cfg.init_device, 'before sharding')
        world = dist.get_world_size()
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
            # A mesh rather than FSDP1's own intra-node groups: the sharded state dicts are
            # then DTensors over the whole world, so a DCP save covers every rank (#102904).
            device_mesh=_HYBRID.build(device, world, local_world_size() or world, hybrid=True)
            if cfg.hybrid else None,
            forward_prefetch=cfg.forward_prefetch,
            limit_all_gathers=cfg.limit_all_gathers,
            # FSDP1 broadcasts only tensors on an accelerator; on the CPU materialize() did
            sync_module_states=bool(cfg.sync_module_states) or (on_meta and device.type != 'cpu'),
            use_orig_params=True)
        set_preprocessor_device(self.module, device)
        base.prepare_layers(self, layout)  # inside the units: FSDP1's hooks stay outside it
        self._accumulation = cfg.accumulation
        self._low_precision = cfg.low_precision
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
        base.refuse_keyword_build(type(self), config, layout, options)
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
        self._low_precision = cfg.low_precision

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
