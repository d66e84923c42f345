"""What every mmfsdp wrapper shares: the resolved config, the layout, the one base class.

- :class:`WrapperConfig` and :class:`Layout`: a ``model_wrapper_cfg`` resolved
  once into typed values, and the model (its :class:`~mmfsdp.policies.ModelIndex`)
  cut once into units. The runner computes both and hands them to every consumer.
- :func:`prepare_layers`: what is done to layers before sharding (checkpoint,
  then compile), the same for every wrapper.
- :class:`ParallelWrapper`: the one base class: mmengine's ``train_step`` /
  ``val_step`` / ``test_step`` through the wrapper's forward (FSDP gathers
  there), ``no_sync`` as ``accumulation`` says, clipping by the global norm.
  Sharded wrappers are built as ``Wrapper(module, config=..., layout=...)``
  (what :class:`mmfsdp.FSDPRunner` passes) or, by hand,
  ``Wrapper.from_options(module, **options)``; mmengine's stock ``Runner`` and
  ``FlexibleRunner`` pass keyword options and are refused for it
  (:func:`refuse_keyword_build`).
"""
import contextlib
import dataclasses
import enum
import logging
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Dict, Iterator, List, Mapping, Optional, Tuple, Type

import torch
from mmengine.logging import print_log
from mmengine.model import BaseModel
from mmengine.model.utils import detect_anomalous_params
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import options, policies
from ..checkpointing import (
    AC_KEY,
    ActivationCheckpointing,
    apply_activation_checkpointing_to,
    resolve_activation_checkpointing,
)
from ..compat import (
    checkpoint_inner,
    dcp_drops_names,
    full_precision,
    set_activation_memory_budget,
)
from ..compile import COMPILE_KEY, RegionalCompile, compile_layers, resolve_regional_compile
from ..dist import current_device
from ..names import note_checkpoint_keys
from ..optim import clip_grads_by_global_norm
from ..options import Accumulation
from ..policies import (
    ModelIndex,
    PolicyConfig,
    WrapPolicy,
    build_wrap_policy,
    merge_units_sharing_parameters,
    plan_units,
    within,
)

#: The step methods mmengine's loops call on a model (wrapper).
STEPS = ('train_step', 'val_step', 'test_step')
#: ``mesh`` value meaning "the processes of one node" (torchrun's ``LOCAL_WORLD_SIZE``).
NODE = 'node'


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


@dataclass(frozen=True)
class MeshSpec:
    """The data-parallel mesh: ``replicate`` groups of ``shard`` ranks (``-1``: the rest).

    ::

        model_wrapper_cfg = dict(type='mmfsdp.MMFullyShard', mesh=dict(replicate=2, shard='node'))
    """

    replicate: int = 1
    shard: Any = -1

    def sizes(self, world_size: int, local_world_size: Optional[int] = None) -> Tuple[int, int]:
        """``(replicate, shard)`` for ``world_size`` ranks; ``ValueError`` if they do not fit.

        ``shard='node'`` is ``local_world_size`` ranks, at most the world.
        """
        replicate, shard = self.replicate, self.shard
        if shard == NODE:
            if local_world_size is None:
                raise ValueError("model_wrapper_cfg.mesh.shard: "
                                 "'node' needs LOCAL_WORLD_SIZE (set by torchrun); "
                                 'give the shard group size as an int instead')
            shard = min(local_world_size, world_size)
            if world_size % shard:
                raise ValueError(f'LOCAL_WORLD_SIZE: {shard} ranks per node do not divide the '
                                 f'world size {world_size}; sharding within a node needs the '
                                 'same number of ranks on every node')
        if replicate == -1 and shard == -1:
            raise ValueError('model_wrapper_cfg.mesh: replicate and shard cannot both be -1')
        if replicate == -1:
            replicate = world_size // shard if world_size % shard == 0 else 0
        elif shard == -1:
            shard = world_size // replicate if world_size % replicate == 0 else 0
        if replicate * shard != world_size:
            raise ValueError('model_wrapper_cfg.mesh: '
                             f'replicate={self.replicate} x shard={self.shard} does not '
                             f'match the world size {world_size}; replicate * shard must '
                             'equal it (use -1 for "the rest")')
        return replicate, shard

    def build(self, device: torch.device, world_size: int, local: Optional[int],
              hybrid: bool = False) -> DeviceMesh:
        """A 1-D ``('shard',)`` mesh, or 2-D ``('replicate', 'shard')`` (``hybrid`` or R > 1)."""
        replicate, shard = self.sizes(world_size, local)
        if replicate == 1 and not hybrid:
            return init_device_mesh(device.type, (shard, ), mesh_dim_names=('shard', ))
        return init_device_mesh(device.type, (replicate, shard),
                                mesh_dim_names=('replicate', 'shard'))


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

    def slice(self, root: str) -> 'Layout':
        """The part of this layout inside child ``root``, named from it (a separate root's)."""
        def inside(names: Tuple[str, ...]) -> Tuple[str, ...]:
            return tuple(n[len(root) + 1:] for n in names if n.startswith(f'{root}.'))

        return dataclasses.replace(self, units=inside(self.units), roots=None,
                                   fp32_modules=inside(self.fp32_modules))


def units_children_first(units: Tuple[str, ...], extra: Tuple[str, ...]) -> Tuple[str, ...]:
    """``units`` (children first) with each of ``extra`` inserted before the units enclosing it."""
    merged = list(units)
    for name in extra:
        if name not in merged:
            at = next((i for i, unit in enumerate(merged) if within(name, unit)), len(merged))
            merged.insert(at, name)
    return tuple(merged)


def outermost(model: nn.Module) -> Dict[int, nn.Module]:
    """``id(layer) -> its checkpoint wrapper`` for every checkpointed layer of ``model``."""
    return {id(checkpoint_inner(m)): m for m in model.modules() if checkpoint_inner(m) is not None}


def prepare_layers(model: nn.Module, layout: Layout) -> None:
    """Checkpoint, then compile, the layers ``layout`` names (before they are sharded).

    A compiled layer that is checkpointed is compiled as its checkpoint
    wrapper; a layer inside another compiled layer is compiled as part of it.
    """
    apply_activation_checkpointing_to(model, layout.checkpoint_layers, layout.checkpointing,
                                      layout.compile_layers)
    checkpointing = layout.checkpointing
    if checkpointing is not None and not checkpointing.wraps_layers:
        set_activation_memory_budget(checkpointing.memory_budget)
        print_log(f'{AC_KEY}: torch.compile keeps at most {checkpointing.memory_budget:g} of the '
                  'activations of the compiled layers (torch._functorch.config.'
                  'activation_memory_budget, set for this process)', logger='current',
                  level=logging.INFO)
    if layout.compile_layers:
        compile_layers(model, layout.compile_layers, layout.regional_compile, outermost(model))


def _flag_or_none(value: Any, key: str) -> Optional[bool]:
    return None if value is None else options.resolve_flag(value, key)


#: How a field is resolved from its annotation, when its config has no resolver for it.
_BY_TYPE: Mapping[Any, Callable[[Any, str], Any]] = {
    bool: options.resolve_flag, Optional[bool]: _flag_or_none}


@dataclass(frozen=True)
class WrapperConfig:
    """Base of the resolved wrapper configs (frozen dataclasses): the options all share.

    :meth:`from_dict` turns a ``model_wrapper_cfg`` into typed values, one
    field per option: through the config's :attr:`RESOLVERS`, else by the
    field's type (``bool``, an enum); model-dependent options stay as written
    until :meth:`layout` checks them against the model.
    """

    #: Which submodules become their own unit (see :mod:`mmfsdp.policies`).
    auto_wrap_policy: PolicyConfig = None
    #: ``dict(layer_cls=[...], mode=...)``: layers whose activations are
    #: recomputed in backward (:mod:`mmfsdp.checkpointing`).
    activation_checkpointing: Optional[ActivationCheckpointing] = None
    #: ``dict(layer_cls=[...], **torch.compile options)``: layers compiled one by
    #: one (:mod:`mmfsdp.compile`).
    regional_compile: Optional[RegionalCompile] = None
    #: ``'meta'``: build on the meta device, never holding the full model.
    init_device: Optional[str] = None
    #: ``'sharded'`` reduce-scatters every micro-step, ``'unsharded'`` keeps full
    #: local gradients until the last (:class:`~mmfsdp.options.Accumulation`).
    accumulation: Accumulation = Accumulation.SHARDED
    #: ``mixed_precision.fp32_modules``: module classes (or their names) that
    #: compute in fp32 under a lower ``param_dtype``, each its own unit.
    fp32_modules: Tuple[Any, ...] = options.FP32_MODULES_DEFAULT

    #: ``option -> resolver`` (raising on bad input) of this config's own options.
    RESOLVERS: ClassVar[Mapping[str, Callable[[Any], Any]]] = {}
    #: The wrapper's name in configs and errors.
    NAME: ClassVar[str] = ''
    #: For a model with its own steps, children whose parameters are all frozen stay unwrapped.
    trainable_roots_only: ClassVar[bool] = False
    #: Every forward, evaluation's too, is a collective (it all-gathers the units).
    collective_forward: ClassVar[bool] = False
    #: The wrapped model's parameters keep their shapes (not FSDP1's flat shards).
    shapes_kept: ClassVar[bool] = True

    def __post_init__(self) -> None:
        """Refuse a combination the options cannot honour together."""
        checkpointing = self.activation_checkpointing
        if checkpointing is not None and not checkpointing.wraps_layers and \
                self.regional_compile is None:
            raise ValueError(f"{AC_KEY}: mode='memory_budget' acts through torch.compile's "
                             'partitioner and so needs compiled layers: add '
                             f"{COMPILE_KEY}=dict(layer_cls=[...]), or use mode='full' / "
                             "'selective' with layer_cls")

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> Any:
        """Resolve a ``model_wrapper_cfg`` (without ``type``), raising on bad input."""
        given = options.move_fp32_modules(cfg)
        types = {f.name: f.type for f in fields(cls)}
        options.check_keys(given, types, 'model_wrapper_cfg')
        resolvers = {**_RESOLVERS, **cls.RESOLVERS}
        resolved = {}
        for name, value in given.items():
            key = f'model_wrapper_cfg.{name}'
            if name in resolvers:
                resolved[name] = resolvers[name](value)
            elif isinstance(types[name], type) and issubclass(types[name], enum.Enum):
                resolved[name] = options.resolve_enum(value, types[name], key)
            else:
                resolved[name] = _BY_TYPE.get(types[name], lambda v, _: v)(value, key)
        return cls(**resolved)

    @property
    def compute_dtype(self) -> Optional[torch.dtype]:
        """The dtype mixed precision computes in (``None``: the parameters' own)."""
        return getattr(getattr(self, 'mixed_precision', None), 'param_dtype', None)

    @property
    def low_precision(self) -> bool:
        """Whether mixed precision computes below fp32 (bf16, fp16)."""
        return self.compute_dtype is not None and self.compute_dtype.itemsize < 4

    def layout(self, index: Any) -> Layout:
        """Check the model-dependent options against the model (or its index); cut it in units."""
        index = ModelIndex.of(index)
        module = index.model
        policy = build_wrap_policy(self.auto_wrap_policy, index)
        units = tuple(merge_units_sharing_parameters(index, plan_units(index, policy))[0]
                      if policy is not None else ())
        if policy is not None and not units and getattr(policy, 'func', None) is policies.auto:
            print_log(f"model_wrapper_cfg.auto_wrap_policy='auto': {type(module).__name__} has no "
                      'repeated block (two or more instances of a class made of layers), so '
                      'the whole model is one unit; name the units with dict(type='
                      "'size_based', min_num_params=...) or 'module_types'", logger='current',
                      level=logging.WARNING)
            policy = None
        if policy is not None and not units:
            raise ValueError(f'model_wrapper_cfg.auto_wrap_policy: {self.auto_wrap_policy!r} '
                             f'makes no unit of any submodule of {type(module).__name__}, so '
                             'nothing would be sharded separately; check the class names / '
                             'thresholds, or use auto_wrap_policy=None to shard the whole model '
                             'as one unit on purpose')
        roots = None
        if own_steps(module):
            roots = tuple(separate_roots(module, self.NAME, self.trainable_roots_only))
        classes = index.classes_of(self.fp32_modules, options.FP32_KEY)  # names checked either way
        low = self.low_precision
        kept = [n for n, m in index.modules.items() if low and isinstance(m, classes)]
        fp32 = tuple(n for n in kept if not any(within(n, k) for k in kept if k != n))
        return Layout(policy=policy, units=units, roots=roots, fp32_modules=fp32,
                      **self._layers(index))

    def _layers(self, index: ModelIndex) -> Dict[str, Any]:
        """The layout's checkpointed and compiled layers, named in the model of ``index``."""
        ac, compiled = self.activation_checkpointing, self.regional_compile
        return dict(checkpointing=ac, regional_compile=compiled,
                    checkpoint_layers=index.classes_of(ac and ac.layer_cls, f'{AC_KEY}.layer_cls'),
                    compile_layers=index.classes_of(compiled and compiled.layer_cls,
                                                    f'{COMPILE_KEY}.layer_cls'))

    def check_device(self, device: torch.device) -> None:
        """Raise on options the training device cannot honour."""

    @property
    def offloads_to_cpu(self) -> bool:
        """Whether the parameters stay on the CPU while training."""
        return False

    def stages_on_cpu(self, device: torch.device) -> bool:
        """Whether the runner keeps the model on the CPU until the wrapper moves it per unit."""
        return False


#: The resolvers of the options every wrapper config has.
_RESOLVERS: Mapping[str, Callable[[Any], Any]] = dict(
    activation_checkpointing=resolve_activation_checkpointing,
    regional_compile=resolve_regional_compile,
    init_device=options.resolve_init_device, fp32_modules=options.check_fp32_modules)


def refuse_keyword_build(wrapper: type, config: Any, layout: Any, options: Mapping) -> None:
    """Raise ``RuntimeError`` unless a sharded wrapper got a resolved ``config`` and ``layout``.

    mmengine's stock ``Runner`` and its ``FlexibleRunner`` build a wrapper from
    the config's keyword options: that is how they are told apart, and refused.
    """
    if config is not None and layout is not None and not options:
        return
    name = wrapper.__name__
    raise RuntimeError(
        f'{name} takes (module, *, config=..., layout=...) as mmfsdp.FSDPRunner builds it, and '
        f'got keyword options {sorted(options)}: this is how mmengine\'s stock Runner and '
        'FlexibleRunner build wrappers, and they initialise weights after sharding, group '
        "parameters by their shards and clip by per-shard norms. Set runner_type='mmfsdp."
        "FSDPRunner' in the config (with model_wrapper_cfg instead of a FlexibleRunner "
        f'strategy); to build one by hand, call {name}.from_options(module, **options)')


class ParallelWrapper(nn.Module):
    """The base of mmfsdp's model wrappers: what the runner, the optimizer and the plan use.

    A wrapper holds the model as ``self.module`` (mmengine's contract) and
    offers mmengine's steps through its own forward (a model that defines a
    step itself, a GAN's ``train_step``, gets it called), ``no_sync`` as
    ``model_wrapper_cfg.accumulation`` says and ``clip_grad_norm_`` by the norm
    over all ranks. :attr:`CONFIG` resolves its options.
    """

    #: The wrapped model (mmengine's wrapper contract).
    module: nn.Module
    #: The resolved config class of this wrapper's options.
    CONFIG: ClassVar[Type[WrapperConfig]]
    #: Whether the wrapper materialises a model built on the meta device.
    supports_meta_init: ClassVar[bool] = False
    #: mmengine's DDP option: log parameters that took no part in the loss.
    detect_anomalous_params: bool = False
    #: ``model_wrapper_cfg.accumulation``.
    _accumulation: Accumulation = Accumulation.SHARDED
    #: Whether the backward of the next forward reduces gradients (False inside no_sync).
    _sync_next_backward: bool = True
    #: Whether it also all-reduces them across replicas (False inside a hybrid no_sync).
    _all_reduce_next_backward: bool = True
    #: Whether mixed precision computes below fp32: ``val_step`` / ``test_step`` compute in fp32.
    _low_precision: bool = False

    @classmethod
    def from_options(cls, module: nn.Module, **options: Any) -> nn.Module:
        """Wrap ``module`` with keyword options, by hand (``options``: ``model_wrapper_cfg``)."""
        config = cls.CONFIG.from_dict(options)
        config.check_device(current_device())
        note_checkpoint_keys(module)
        return cls.wrap(module, config, config.layout(ModelIndex(module)))

    @classmethod
    def wrap(cls, module: nn.Module, config: WrapperConfig, layout: Layout) -> nn.Module:
        """The wrapper of ``config`` around ``module``, laid out as ``layout``."""
        return cls(module, config=config, layout=layout)

    def train_step(self, data: Any, optim_wrapper: Any) -> Dict[str, torch.Tensor]:
        """Forward, backward and (on update iterations) step; returns the log variables."""
        with self._step():
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

    def val_step(self, data: Any) -> list:
        """Predictions for a validation batch (``mode='predict'``), or the model's own."""
        return self._predict('val_step', data)

    def test_step(self, data: Any) -> list:
        """Predictions for a test batch (``mode='predict'``), or the model's own."""
        return self._predict('test_step', data)

    def _predict(self, step: str, data: Any) -> list:
        """Predictions computed in full precision, as mmengine's loops evaluate under AMP."""
        precision = full_precision(self) if self._low_precision else contextlib.nullcontext()
        with self._step(), precision:
            return (getattr(self.module, step)(data) if step in own_steps(self.module) else
                    self._run_forward(self.module.data_preprocessor(data, training=False),
                                      'predict'))

    def _run_forward(self, data: Any, mode: str) -> Any:
        if isinstance(data, dict):
            return self(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self(*data, mode=mode)
        raise TypeError('the data_preprocessor must return a dict, list or tuple, '
                        f'got {type(data).__name__}')

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """What mmengine enters on accumulation micro-steps; follows ``accumulation``.

        mmengine's ``optim_context`` enters ``no_sync`` around the forward only
        and runs backward after leaving it, so (as with DDP) the setting is
        recorded here and the wrapper applies it at its next forward.
        ``'sharded'``: nothing (every micro-step reduce-scatters); ``'unsharded'``:
        full local gradients until a forward outside; ``'hybrid'``: no
        all-reduce across replicas until a forward outside.
        """
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

    @contextlib.contextmanager
    def outside_step(self) -> Iterator[None]:
        """Inside, the model's own methods (``generate``) and its submodules run as under DDP.

        FSDPRunner enters it around every hook call: mmengine's hooks may call the
        unwrapped model outside the training step (XTuner's ``EvaluateChatHook``
        calls ``model.generate``). Data parallelism needs nothing; a sharded
        wrapper gathers what its units do not gather themselves (:meth:`gather_root`)
        at the first forward of one of the model's modules, and shards it again at
        the end. Every rank must call the model alike, as in the training step.
        """
        if not self.shards_parameters:
            yield
            return
        members = {id(m) for m in self.module.modules()}
        self._outside = stack = contextlib.ExitStack()

        def before(module: nn.Module, args: Any) -> None:
            if module is self:  # the wrapper's own forward (a hook's direct call) is a step
                self._steps += 1
            elif not (self._steps or self._root_gathered) and id(module) in members:
                self._root_gathered = True
                stack.callback(setattr, self, '_root_gathered', False)
                self.gather_root(stack)

        def after(module: nn.Module, args: Any, output: Any) -> None:
            if module is self:
                self._steps -= 1

        handles = (nn.modules.module.register_module_forward_pre_hook(before),
                   nn.modules.module.register_module_forward_hook(after))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._outside = None
            stack.close()

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """The wrapper's own step, which gathers for itself.

        What a hook gathered (:meth:`outside_step`) is sharded again first.
        """
        if self._outside is not None:
            self._outside.close()
        self._steps += 1
        try:
            yield
        finally:
            self._steps -= 1

    #: :meth:`outside_step`'s gathered state, while it is entered.
    _outside: Optional[contextlib.ExitStack] = None
    _root_gathered: bool = False
    #: How many of the wrapper's own steps (or forwards) are running.
    _steps: int = 0

    #: Whether parameters are sharded: a forward outside the step needs :meth:`gather_root`.
    shards_parameters: ClassVar[bool] = False

    def gather_root(self, stack: contextlib.ExitStack) -> None:
        """Gather the root's parameters (no unit does) until ``stack`` closes; collective."""
        raise NotImplementedError

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip all gradients by their norm over all ranks; return it as a plain tensor."""
        return clip_grads_by_global_norm(self, self.parameters(), max_norm, norm_type)


@dcp_drops_names
class ModelHolder(ParallelWrapper):
    """A wrapper that holds the model in ``self.module`` and answers with the model's names.

    Everything named (parameters, buffers, modules, state dicts, DCP's
    ``get_state_dict``) answers as the unwrapped model does, so names and
    full checkpoints move freely between wrappers and one process. Only the
    structure keeps the wrapper: ``children()`` gives the model, so torch's
    recursive methods (``train``, ``to``, ``zero_grad``) reach it.
    """

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

    def named_modules(self, memo: Optional[set] = None, prefix: str = '',
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
