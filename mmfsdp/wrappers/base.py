"""What every mmfsdp wrapper shares: the protocol, the resolved config, the steps, the guard.

- :class:`ParallelWrapper`: what :class:`mmfsdp.FSDPRunner`, the optimizer
  set-up, the plan and the rank agreement ask of a wrapper class.
- :class:`WrapperConfig` and :class:`Layout`: a ``model_wrapper_cfg`` resolved
  once into typed values, and the model walked once into its units. The
  runner computes both and hands them to every consumer.
- :class:`DataParallelSteps`: mmengine's ``train_step`` / ``val_step`` /
  ``test_step`` through the wrapper's forward (FSDP gathers there).
- :class:`ShardingSpec`: what a wrapper will do with a model, without doing
  it; the input of the memory plan and of the ranks' agreement.
- :func:`reject_stock_runner`: sharded wrappers refuse mmengine's stock
  ``Runner`` and ``FlexibleRunner``, which initialise and clip in ways that
  sharding breaks.
"""
import abc
import contextlib
import enum
from dataclasses import dataclass, fields
from typing import (
    Any,
    Callable,
    ClassVar,
    ContextManager,
    Dict,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
    Type,
    Union,
)

import torch
from mmengine.model import BaseModel
from mmengine.model.utils import detect_anomalous_params
from mmengine.optim import OptimWrapper
from mmengine.runner import FlexibleRunner, Runner
from torch import nn

from ..compat import DCPNameHook, call_stack
from ..dist import current_device
from ..layers import (
    AC_KEY,
    COMPILE_KEY,
    ActivationCheckpointing,
    RegionalCompile,
    check_layer_options,
    layer_classes,
    resolve_activation_checkpointing,
    resolve_regional_compile,
)
from ..options import (
    Accumulation,
    Fp32Modules,
    check_keys,
    computes_in_low_precision,
    resolve_fp32_modules,
)
from ..policies import PolicyConfig, WrapPolicy, build_wrap_policy, plan_units

__all__ = ['Construction', 'DataParallelSteps', 'LAYER_RESOLVERS', 'Layout', 'ModelHolder',
           'Padding', 'ParallelWrapper', 'STEPS', 'ShardingSpec', 'WrapperConfig',
           'fp32_module_names', 'is_parallel_wrapper', 'own_steps', 'reject_stock_runner',
           'separate_roots', 'units_children_first', 'within']

#: The step methods mmengine's loops call on a model (wrapper).
STEPS = ('train_step', 'val_step', 'test_step')

Data = Union[dict, tuple, list]
Resolver = Callable[[Any], Any]


def own_steps(module: nn.Module) -> List[str]:
    """The steps ``module``'s class defines itself instead of inheriting ``BaseModel``'s."""
    return [step for step in STEPS
            if getattr(type(module), step, None) not in (None, getattr(BaseModel, step))]


def separate_roots(module: nn.Module, wrapper: str, trainable_only: bool = False) -> List[str]:
    """The top-level children of a model with its own steps, each sharded as its own root.

    Such a model calls its children directly, past the wrapper's forward, so
    each child with parameters (``trainable_only``: with a trainable one) is a
    root of its own, as mmengine's ``MMSeparateDistributedDataParallel`` gives
    each child its own DDP. Raises ``ValueError`` when the model holds
    parameters itself (they would never be gathered) or has no such child.
    """
    steps = ', '.join(own_steps(module))
    model = type(module).__name__
    direct = [name for name, _ in module.named_parameters(recurse=False)]
    if direct:
        raise ValueError(
            f'model_wrapper_cfg.type={wrapper!r}: {model} defines its own {steps}, which calls '
            'its sub-modules directly, so each child is sharded as its own FSDP root; the '
            f'parameters {direct} belong to {model} itself and would never be gathered. Move '
            'them into a child module, or use model_wrapper_cfg=dict(type='
            "'MMSeparateDistributedDataParallel') (a DDP per child, no sharding)")
    roots = [name for name, child in module.named_children()
             if any(p.requires_grad or not trainable_only for p in child.parameters())]
    if not roots:
        raise ValueError(f'model_wrapper_cfg.type={wrapper!r}: {model} has no child module '
                         'with parameters to shard')
    return roots


class Padding(enum.Enum):
    """How a unit's parameters are split over the ranks of its shard group."""

    #: FSDP1: the unit's parameters are flattened into one vector, padded to a
    #: multiple of the group size and split evenly.
    FLAT = 'flat'
    #: FSDP2: every parameter is split along dim 0, padded to a multiple of
    #: the group size.
    DIM0 = 'dim0'
    #: Not split (DDP, NO_SHARD).
    NONE = 'none'


class Construction(enum.Enum):
    """Where the model's weights live while the wrapper builds it: bounds the construction peak."""

    #: The full model on the device, then sharded (DDP; FSDP2 without meta init).
    FULL = 'full model on the device, then sharded'
    #: The full model on the CPU; FSDP1 moves it to the device unit by unit
    #: (the device holds the shards, one unit and its flat copy).
    UNIT_BY_UNIT = 'full model on the CPU, moved to the device unit by unit'
    #: Built on the meta device; each rank allocates only its shards (FSDP2 meta init).
    SHARDS = 'meta init: only the shards are allocated'


@dataclass(frozen=True)
class ShardingSpec:
    """A wrapper's sharding of one model at one world size."""

    #: The wrapper's registered name, e.g. ``'mmfsdp.MMFullyShardedDataParallel'``.
    wrapper: str
    #: The strategy in the wrapper's own words, e.g. ``'FULL_SHARD'``.
    strategy: str
    #: Ranks that hold different shards of one unit (the ``shard`` mesh dim).
    shard_size: int
    #: Ranks that hold the same shard (the ``replicate`` mesh dim).
    replicate_size: int
    #: The units' module names, children before parents; the root is implied.
    units: Tuple[str, ...]
    padding: Padding
    #: Whether parameters / gradients / optimizer states are split over ``shard_size``.
    shard_params: bool
    shard_grads: bool
    shard_optimizer: bool
    #: Whether gathered parameters stay unsharded from forward until backward
    #: (SHARD_GRAD_OP, ``reshard_after_forward=False``): adds them to the peak.
    keep_gathered_until_backward: bool = False
    #: ``reshard_after_forward=<int>``: between forward and backward the gathered
    #: parameters stay sharded over this many ranks (1: not resharded at all).
    kept_shard_size: int = 1
    #: dtype of the gathered parameters used in compute (mixed precision), or
    #: ``None`` for the parameters' own dtype.
    compute_dtype: Optional[torch.dtype] = None
    #: How the wrapper builds the model (see :class:`Construction`).
    construction: Construction = Construction.FULL
    #: Whether the wrapper all-gathers into unsharded parameters even when
    #: ``shard_size`` is 1 (FSDP2 does; FSDP1 then computes on its shards).
    gathers_unsharded: bool = False
    #: Whether gradients are freed between steps: ``optimizer.zero_grad()`` sets
    #: them to ``None`` (FSDP2's DTensor gradients; FSDP1 then drops its flat
    #: gradient at the next forward), so they exist only from backward to the
    #: optimizer step. DDP's buckets stay allocated.
    grads_freed_between_steps: bool = False
    #: Layer classes wrapped in activation checkpointing (``activation_checkpointing``).
    checkpoint_layers: Tuple[Type[nn.Module], ...] = ()
    #: Whether gradient accumulation keeps full, unsharded gradients between
    #: micro-steps (``accumulation='unsharded'``) instead of the gradient shard.
    unsharded_accumulation: bool = False
    #: Units (also in :attr:`units`) that compute in fp32 under mixed precision
    #: (``mixed_precision.fp32_modules``): gathered in their parameters' dtype.
    fp32_units: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Layout:
    """How a config cuts one model into units: the result of the one walk over the model.

    Computed by :meth:`WrapperConfig.layout` before any collective; the rank
    agreement, the plan and the wrapper all read it.
    """

    #: The built wrap policy (``None``: the whole model is one unit).
    policy: Optional[WrapPolicy] = None
    #: Submodules that become units, children first (FSDP2: merged for shared parameters).
    units: Tuple[str, ...] = ()
    #: Layer classes whose activations are recomputed in backward.
    checkpoint_layers: Tuple[Type[nn.Module], ...] = ()
    #: How they are recomputed (``activation_checkpointing``; ``None``: off).
    checkpointing: Optional[ActivationCheckpointing] = None
    #: Layer classes compiled one by one (``regional_compile``), and how.
    compile_layers: Tuple[Type[nn.Module], ...] = ()
    regional_compile: Optional[RegionalCompile] = None
    #: For a model with its own steps: the children sharded as separate roots.
    roots: Optional[Tuple[str, ...]] = None
    #: Submodules that compute in fp32 under mixed precision
    #: (``mixed_precision.fp32_modules``), children first; empty when nothing
    #: computes below fp32.
    fp32_modules: Tuple[str, ...] = ()


def fp32_module_names(module: nn.Module, fp32_modules: Fp32Modules,
                      param_dtype: Optional[torch.dtype]) -> Tuple[str, ...]:
    """The outermost submodules of ``fp32_modules`` classes (one inside another adds nothing).

    Empty unless ``param_dtype`` computes below fp32; the names are checked
    against ``module`` either way.
    """
    classes = resolve_fp32_modules(fp32_modules, module)
    if not classes or not computes_in_low_precision(param_dtype):
        return ()
    kept = [name for name, m in module.named_modules() if isinstance(m, classes)]
    return tuple(name for name in kept if not any(within(name, k) for k in kept if k != name))


def within(name: str, ancestor: str) -> bool:
    """Whether module ``name`` is ``ancestor`` or below it (``''`` is the root)."""
    return ancestor == '' or name == ancestor or name.startswith(f'{ancestor}.')


def units_children_first(units: Tuple[str, ...], extra: Tuple[str, ...]) -> Tuple[str, ...]:
    """``units`` (children first) with each of ``extra`` inserted before the units enclosing it."""
    merged = list(units)
    for name in extra:
        if name not in merged:
            at = next((i for i, unit in enumerate(merged) if within(name, unit)), len(merged))
            merged.insert(at, name)
    return tuple(merged)


class WrapperConfig:
    """Base of the resolved wrapper configs (frozen dataclasses).

    :meth:`from_dict` turns a ``model_wrapper_cfg`` into typed values through
    :attr:`RESOLVERS` (one per option; model-dependent options stay as
    written until :meth:`layout` checks them against the model).
    """

    #: ``option -> resolver`` (raising on bad input); options without one are kept as written.
    RESOLVERS: ClassVar[Mapping[str, Resolver]] = {}
    #: Keys accepted besides the fields, turned into fields by :meth:`_translate`.
    TRANSLATED: ClassVar[Tuple[str, ...]] = ()
    #: The wrapper's name in configs and errors.
    NAME: ClassVar[str] = ''
    #: For a model with its own steps, children whose parameters are all frozen stay unwrapped.
    trainable_roots_only: ClassVar[bool] = False

    auto_wrap_policy: PolicyConfig
    activation_checkpointing: Optional[ActivationCheckpointing]
    regional_compile: Optional[RegionalCompile]
    init_device: Optional[str]
    accumulation: Accumulation

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> Any:
        """Resolve a ``model_wrapper_cfg`` (without ``type``), raising on bad input."""
        check_keys(cfg, [f.name for f in fields(cls)] + list(cls.TRANSLATED), 'model_wrapper_cfg')
        options = cls._translate(dict(cfg))
        resolvers = {**LAYER_RESOLVERS, **cls.RESOLVERS}
        config = cls(**{name: resolvers.get(name, _as_is)(value)
                        for name, value in options.items()})
        check_layer_options(config.activation_checkpointing, config.regional_compile)
        return config

    @classmethod
    def _translate(cls, cfg: Dict[str, Any]) -> Dict[str, Any]:
        return cfg

    def layout(self, module: nn.Module) -> Layout:
        """Check the model-dependent options against ``module`` and walk it once into units."""
        policy = build_wrap_policy(self.auto_wrap_policy, module)
        units = tuple(plan_units(module, policy)) if policy is not None else ()
        if policy is not None and not units:
            raise ValueError(f'model_wrapper_cfg.auto_wrap_policy: {self.auto_wrap_policy!r} '
                             f'makes no unit of any submodule of {type(module).__name__}, so '
                             'nothing would be sharded separately; check the class names / '
                             'thresholds, or use auto_wrap_policy=None to shard the whole model '
                             'as one unit on purpose')
        roots = None
        if own_steps(module):
            roots = tuple(separate_roots(module, self.NAME, self.trainable_roots_only))
            self._check_own_steps(module)
        return Layout(policy=policy, units=self._merge(module, units), roots=roots,
                      fp32_modules=self._fp32_modules(module), **self._layers(module))

    def _layers(self, module: nn.Module) -> Dict[str, Any]:
        """The layout's checkpointed and compiled layers (:mod:`mmfsdp.layers`)."""
        return dict(
            checkpoint_layers=layer_classes(self.activation_checkpointing, module, AC_KEY),
            checkpointing=self.activation_checkpointing,
            compile_layers=layer_classes(self.regional_compile, module, COMPILE_KEY),
            regional_compile=self.regional_compile)

    def _merge(self, module: nn.Module, units: Tuple[str, ...]) -> Tuple[str, ...]:
        return units

    def _fp32_modules(self, module: nn.Module) -> Tuple[str, ...]:
        """Names of the submodules kept in fp32 under this config's mixed precision."""
        return ()

    def _check_own_steps(self, module: nn.Module) -> None:
        """Raise on options that a model running its own steps cannot honour."""

    def sharding_spec(self, layout: Layout, world_size: int) -> ShardingSpec:
        """How this config shards the model of ``layout`` over ``world_size`` ranks."""
        raise NotImplementedError

    def check_device(self, device: torch.device) -> None:
        """Raise on options the training device cannot honour."""

    @property
    def offloads_to_cpu(self) -> bool:
        """Whether the parameters stay on the CPU while training."""
        return False

    def stages_on_cpu(self, device: torch.device) -> bool:
        """Whether the runner keeps the model on the CPU until the wrapper moves it per unit."""
        return False


def _as_is(value: Any) -> Any:
    return value


#: The resolvers of the options every wrapper has (:mod:`mmfsdp.layers`).
LAYER_RESOLVERS: Mapping[str, Resolver] = dict(
    activation_checkpointing=resolve_activation_checkpointing,
    regional_compile=resolve_regional_compile)


def resolved(config_cls: Type[WrapperConfig], config: Optional[WrapperConfig],
             options: Mapping[str, Any]) -> Any:
    """``config`` if given (then no ``options``), else ``options`` resolved."""
    if config is None:
        return config_cls.from_dict(options)
    if options:
        raise TypeError(f'{config_cls.NAME}: give a resolved config or options, not both '
                        f'(got config and {sorted(options)})')
    return config


class ParallelWrapper(abc.ABC):
    """What an mmfsdp model wrapper offers the runner, the optimizer, the plan and checkpoints.

    A wrapper is an ``nn.Module`` holding the model as ``self.module``
    (mmengine's contract), built as ``Wrapper(module, **options)`` or, by the
    runner, ``Wrapper(module, config=..., layout=...)`` from the objects it
    resolved once. :attr:`CONFIG` resolves options; instance members serve
    training.
    """

    #: The wrapped model (mmengine's wrapper contract).
    module: nn.Module
    #: The resolved config class of this wrapper's options.
    CONFIG: ClassVar[Type[WrapperConfig]]
    #: Whether the wrapper materialises a model built on the meta device.
    supports_meta_init: ClassVar[bool] = False

    @classmethod
    def check_config(cls, config: Mapping[str, Any], module: Optional[nn.Module] = None) -> None:
        """Raise on a bad config for this device; with ``module``, on model-dependent ones."""
        resolved_cfg = cls.CONFIG.from_dict(config)
        resolved_cfg.check_device(current_device())
        if module is not None:
            resolved_cfg.layout(module)

    @classmethod
    def sharding_spec(cls, config: Mapping[str, Any], module: nn.Module,
                      world_size: int) -> ShardingSpec:
        """How ``config`` shards ``module`` over ``world_size`` ranks, without sharding."""
        resolved_cfg = cls.CONFIG.from_dict(config)
        return resolved_cfg.sharding_spec(resolved_cfg.layout(module), world_size)

    @abc.abstractmethod
    def no_sync(self) -> ContextManager[None]:
        """Within the context, backward accumulates gradients locally, unreduced."""

    @abc.abstractmethod
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients to a norm over all ranks of at most ``max_norm`` (collective)."""

    @abc.abstractmethod
    def train_step(self, data: Any, optim_wrapper: Any) -> Dict[str, torch.Tensor]:
        """The training step of mmengine's loops, through the wrapper's forward."""

    @abc.abstractmethod
    def val_step(self, data: Any) -> list:
        """The validation step of mmengine's loops."""

    @abc.abstractmethod
    def test_step(self, data: Any) -> list:
        """The test step of mmengine's loops."""


def is_parallel_wrapper(wrapper_cls: Any) -> bool:
    """Whether ``wrapper_cls`` (a class) implements :class:`ParallelWrapper`."""
    return isinstance(wrapper_cls, type) and issubclass(wrapper_cls, ParallelWrapper)


class DataParallelSteps:
    """mmengine's ``BaseModel`` steps for a wrapper holding the model in ``self.module``.

    The forward always goes through the *wrapper*, so FSDP gathers parameters
    for prediction as well as for training. A model that defines a step itself
    (a GAN's ``train_step``, ``BaseTTAModel.test_step``) gets it called.
    """

    #: mmengine's DDP option: log parameters that took no part in the loss.
    detect_anomalous_params: bool = False

    def train_step(self, data: Data, optim_wrapper: OptimWrapper) -> Dict[str, torch.Tensor]:
        """Forward, backward and (on update iterations) step; returns the log variables."""
        if 'train_step' in own_steps(self.module):
            return self.module.train_step(data, optim_wrapper)
        with optim_wrapper.optim_context(self):
            data = self.module.data_preprocessor(data, training=True)
            losses = self._run_forward(data, mode='loss')
        parsed_loss, log_vars = self.module.parse_losses(losses)
        if self.detect_anomalous_params:
            detect_anomalous_params(parsed_loss, model=self)
        optim_wrapper.update_params(parsed_loss)
        return log_vars

    def val_step(self, data: Data) -> list:
        """Predictions for a validation batch (``mode='predict'``), or the model's own."""
        if 'val_step' in own_steps(self.module):
            return self.module.val_step(data)
        return self._run_forward(self.module.data_preprocessor(data, training=False), 'predict')

    def test_step(self, data: Data) -> list:
        """Predictions for a test batch (``mode='predict'``), or the model's own."""
        if 'test_step' in own_steps(self.module):
            return self.module.test_step(data)
        return self._run_forward(self.module.data_preprocessor(data, training=False), 'predict')

    def _run_forward(self, data: Data, mode: str) -> Any:
        if isinstance(data, dict):
            return self(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self(*data, mode=mode)
        raise TypeError('the data_preprocessor must return a dict, list or tuple, '
                        f'got {type(data).__name__}')


class AccumulationNoSync:
    """``no_sync`` that follows ``model_wrapper_cfg.accumulation``, decided at forward time.

    mmengine's ``optim_context`` enters ``no_sync`` around the forward only and
    runs backward after leaving it, so (as with DDP) the setting is recorded
    here and the wrapper applies it at its next forward. ``'sharded'``: nothing
    (every micro-step reduce-scatters); ``'unsharded'``: full local gradients
    until a forward outside; ``'hybrid'``: no all-reduce across replicas until
    a forward outside.
    """

    _accumulation: Accumulation = Accumulation.SHARDED
    #: Whether the backward of the next forward reduces gradients (False inside no_sync).
    _sync_next_backward: bool = True
    #: Whether it also all-reduces them across replicas (False inside a hybrid no_sync).
    _all_reduce_next_backward: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """What mmengine enters on accumulation micro-steps; follows ``accumulation``."""
        if self._accumulation is Accumulation.SHARDED:
            yield
            return
        flag = ('_all_reduce_next_backward' if self._accumulation is Accumulation.HYBRID
                else '_sync_next_backward')
        previous = getattr(self, flag)
        setattr(self, flag, False)
        try:
            yield
        finally:
            setattr(self, flag, previous)


class ModelHolder(DCPNameHook, nn.Module):
    """A wrapper that holds the model in ``self.module`` and answers with the model's names.

    Everything named (parameters, buffers, modules, state dicts, DCP's
    ``get_state_dict``) answers as the unwrapped model does, so names and
    full checkpoints move freely between wrappers and one process. Only the
    structure keeps the wrapper: ``children()`` gives the model, so torch's
    recursive methods (``train``, ``to``, ``zero_grad``) reach it.
    """

    module: nn.Module

    def named_parameters(self, prefix: str = '', recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """The model's parameters under the unwrapped model's names."""
        owner = self.module if recurse else super()
        return owner.named_parameters(prefix=prefix, recurse=recurse,
                                      remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = '', recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, torch.Tensor]]:
        """The model's buffers under the unwrapped model's names."""
        owner = self.module if recurse else super()
        return owner.named_buffers(prefix=prefix, recurse=recurse,
                                   remove_duplicate=remove_duplicate)

    def named_modules(self, memo: Optional[Set[nn.Module]] = None, prefix: str = '',
                      remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Module]]:
        """The model's modules under the unwrapped model's names (the model itself is ``''``)."""
        return self.module.named_modules(memo=memo, prefix=prefix,
                                         remove_duplicate=remove_duplicate)

    def get_submodule(self, target: str) -> nn.Module:
        """The model's submodule of that unwrapped name (``''``: the model)."""
        return self.module.get_submodule(target)

    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The model's state dict, under the unwrapped model's keys."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load a state dict keyed like the unwrapped model."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def dropped_name_components(self) -> Dict[str, str]:
        """Every child of the model is reached through ``module``, which names leave out."""
        return {name: 'module' for name, _ in self.module.named_children()}


_STOCK_WRAP_MODEL = Runner.wrap_model.__code__

#: What each refused runner gets wrong under sharding.
_WHY = {
    'Runner': "mmengine's stock Runner, which initialises weights after sharding, groups "
              'parameters by their shards and clips by per-shard norms',
    'FlexibleRunner': "mmengine's FlexibleRunner, whose strategies build the optimizer on the "
                      'shards and clip by per-shard norms',
}


def reject_stock_runner(wrapper_name: str) -> None:
    """Raise ``RuntimeError`` if mmengine's ``Runner.wrap_model`` or a ``FlexibleRunner`` builds us.

    Neither runner offers a hook before it builds the wrapper, and both call
    the constructor as a user would, so the builder is told apart by the call
    stack: the stock ``wrap_model`` code object, or a ``FlexibleRunner`` method.
    """
    runner = None
    for frame in call_stack():
        if frame.f_code is _STOCK_WRAP_MODEL:
            runner = 'Runner'
            break
        if isinstance(frame.f_locals.get('self'), FlexibleRunner):
            runner = 'FlexibleRunner'
            break
    if runner is not None:
        raise RuntimeError(
            f'{wrapper_name} cannot be used with {_WHY[runner]}; set '
            "runner_type='mmfsdp.FSDPRunner' in the config"
            + (' (with model_wrapper_cfg instead of strategy)' if runner != 'Runner' else ''))
