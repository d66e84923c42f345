"""Auto-wrap policies: which submodules become their own FSDP unit.

A policy is one predicate that serves FSDP1 and FSDP2 alike, with the signature
torch's FSDP1 ``auto_wrap_policy`` callables have::

    policy(module, recurse, nonwrapped_numel, **options) -> bool

``recurse=True`` asks "look inside ``module``?", ``recurse=False`` asks "make
``module`` a unit?", and ``nonwrapped_numel`` counts the parameters of
``module`` not already claimed by a unit below it. :class:`ModelIndex` is the
one walk over a model (modules, classes, parameter registrations) that the
layout, the policies, the group checks and the plan read; :func:`plan_units`
applies a policy to it with the semantics of FSDP1's recursive wrapping: FSDP1
wraps exactly the units it names, FSDP2 shards them, the plan reports them.

Policies are registered in :data:`mmfsdp.registry.FSDP_WRAP_POLICIES` and named
in configs::

    auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock'])
    auto_wrap_policy=[dict(type='transformer', layer_cls=['Block']),   # any of
                      dict(type='size_based', min_num_params=100_000)]
    auto_wrap_policy='auto'      # the model's blocks (ModelIndex.auto_blocks)

Users register their own predicate, whose extra arguments become config keys::

    @FSDP_WRAP_POLICIES.register_module()
    def big_linears(module, recurse, nonwrapped_numel, min_params=1000):
        return recurse or (isinstance(module, nn.Linear) and nonwrapped_numel >= min_params)

FSDP2's units are merged where a parameter is shared by two of them
(:func:`merge_units_sharing_parameters`). What is done to layers
before sharding is :mod:`mmfsdp.checkpointing` and :mod:`mmfsdp.compile`.
"""
import collections
import difflib
import functools
import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple, Type, Union

from mmengine.logging import print_log
from torch import nn

from .options import one_or_many, suggest
from .registry import FSDP_WRAP_POLICIES


def within(name: str, ancestor: str) -> bool:
    """Whether module ``name`` is ``ancestor`` or below it (``''`` is the root)."""
    return ancestor == '' or name == ancestor or name.startswith(f'{ancestor}.')


class ModelIndex:
    """A model walked once: its modules by name, its classes by name, its parameters.

    Built once per model (:meth:`mmfsdp.wrappers.builder.Wrapping.layout`) and
    passed to everything that asks about the model, so one layout does not walk
    the module tree again for each question.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        #: Every module by its first name (``''``: the model), in ``named_modules`` order.
        self.modules: Dict[str, nn.Module] = {}
        #: ``id(parameter) -> [(parameter name, module name), ...]``, every registration.
        self.registrations: Dict[int, List[Tuple[str, str]]] = {}
        #: Every parameter by its first name (``named_parameters()``).
        self.params: Dict[str, nn.Parameter] = {}
        #: Below each module path: ``id(parameter) -> numel`` (``module.parameters()``).
        self.below: Dict[str, Dict[int, int]] = {}
        #: Class name -> class, for every module's class and its ``nn.Module`` bases.
        self.classes: Dict[str, Type[nn.Module]] = {}
        for path, module in model.named_modules(remove_duplicate=False):
            self.modules.setdefault(path, module)
            self.below.setdefault(path, {})
            for cls in type(module).__mro__:
                if issubclass(cls, nn.Module) and cls is not nn.Module:
                    self.classes.setdefault(cls.__name__, cls)
            for name, param in module.named_parameters(recurse=False):
                full = f'{path}.{name}' if path else name
                if id(param) not in self.registrations:
                    self.params[full] = param
                self.registrations.setdefault(id(param), []).append((full, path))
                parts = path.split('.') if path else []
                for end in range(len(parts) + 1):
                    self.below['.'.join(parts[:end])][id(param)] = param.numel()
        seen: set = set()
        self.modules = {n: m for n, m in self.modules.items()
                        if not (id(m) in seen or seen.add(id(m)))}

    @functools.cached_property
    def repeated_blocks(self) -> Tuple[Type[nn.Module], ...]:
        """The model's repeated blocks: what ``'auto'`` names, outermost first.

        A block class has two or more outermost instances holding parameters,
        is neither a container nor a single layer (it has a submodule with
        parameters), and is not a stage: no instance holds two or more blocks
        of one other class making up half of its parameters (ResNet's ResLayer
        holds Bottlenecks, Swin's stage SwinBlocks). From the largest instances
        down, a class is taken unless one of its instances is inside (or holds)
        a block already taken: TransformerBlock, not its MLP.
        """
        size = {name: sum(below.values()) for name, below in self.below.items()}
        composite = {name: module for name, module in self.modules.items() if name and not
                     isinstance(module, _CONTAINERS) and size[name] > sum(
                         p.numel() for p in module.parameters(recurse=False))}
        every = {cls: [n for n, m in composite.items() if isinstance(m, cls)]  # as policies match
                 for cls in {type(m) for m in composite.values()}}
        outer = {cls: [n for n in names if not any(within(n, o) and n != o for o in names)]
                 for cls, names in every.items()}
        blocks = {cls: names for cls, names in outer.items() if len(names) > 1}
        held: Dict[Tuple[str, type], List[int]] = collections.defaultdict(lambda: [0, 0])
        for cls, names in blocks.items():  # [count, numel] of the cls blocks below a module
            for name in names:
                parts = name.split('.')
                for end in range(1, len(parts)):
                    held['.'.join(parts[:end]), cls][0] += 1
                    held['.'.join(parts[:end]), cls][1] += size[name]
        stages = {cls for cls, names in blocks.items() for name in names for other in blocks
                  if held[name, other][0] > 1 and 2 * held[name, other][1] >= size[name]}
        chosen, units = [], []
        for cls in sorted(blocks.keys() - stages, key=lambda c: -max(size[n] for n in blocks[c])):
            if not any(within(n, u) or within(u, n) for n in every[cls] for u in units):
                chosen.append(cls)
                units += blocks[cls]
        return tuple(chosen)

    @functools.cached_property
    def declared_blocks(self) -> Tuple[Tuple[Type[nn.Module], ...], str]:
        """The block classes the model's own classes declare, and who declares them.

        A Hugging Face ``transformers`` model names the modules that must not be
        split across devices in ``_no_split_modules`` (its decoder layers), the
        blocks accelerate and DeepSpeed keep whole. Wrapped by peft, the decoder
        layers hold only LoRA ``Linear`` layers: by structure alone they would look
        like stages of those.
        """
        declared, owner = [], ''
        for module in self.modules.values():  # outermost first
            names = getattr(type(module), '_no_split_modules', None) or ()
            found = [self.classes[n] for n in names if isinstance(n, str) and n in self.classes]
            owner = owner or (type(module).__name__ if found else '')
            declared += [c for c in found if c not in declared]
        return tuple(declared), owner

    @property
    def auto_blocks(self) -> Tuple[Tuple[Type[nn.Module], ...], str]:
        """What ``'auto'`` names, and why.

        :attr:`declared_blocks` where the model declares any, else its :attr:`repeated_blocks`.
        """
        declared, owner = self.declared_blocks
        if declared:
            return declared, f'the blocks {owner} declares (_no_split_modules)'
        return self.repeated_blocks, 'the repeated blocks'

    @classmethod
    def of(cls, model: Union[nn.Module, 'ModelIndex']) -> 'ModelIndex':
        """``model``'s index (``model`` itself if it is one)."""
        return model if isinstance(model, ModelIndex) else cls(model)

    def classes_of(self, value: Any, key: str) -> Tuple[Type[nn.Module], ...]:
        """Module classes, or names of the classes (or their bases) of the model's modules.

        ``'_BatchNorm'`` covers ``BatchNorm2d`` and ``SyncBatchNorm``; ``'auto'``
        the :attr:`auto_blocks`. An unknown name is a ``ValueError`` with the
        nearest names.
        """
        classes = []
        for item in one_or_many(value or ()):
            if item == 'auto' and 'auto' not in self.classes:
                classes += self.auto_blocks[0]
            elif isinstance(item, type) and issubclass(item, nn.Module):
                classes.append(item)
            elif isinstance(item, str) and item in self.classes:
                classes.append(self.classes[item])
            elif isinstance(item, str):
                close = difflib.get_close_matches(item, sorted(self.classes), n=3, cutoff=0.5)
                hint = (f'close matches: {close}' if close
                        else f'its classes are {sorted(self.classes)}')
                raise ValueError(f'{key}: {type(self.model).__name__} has no submodule of class '
                                 f'{item!r}; {hint}')
            else:
                raise TypeError(f'{key}: expected nn.Module classes or class names, got {item!r}')
        return tuple(classes)


#: A built policy: ``(module, recurse, nonwrapped_numel) -> bool``.
WrapPolicy = Callable[[nn.Module, bool, int], bool]

PolicyConfig = Union[None, str, Mapping[str, Any], Callable, Sequence[Any]]

#: Containers without a ``forward``: never a unit themselves, always looked into.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
#: Modules whose forward reads their children's parameters without calling them: a child
#: unit would hand the parent a shard (``nn.MultiheadAttention`` reads ``out_proj.weight``).
#: Never looked into, by any policy (torch's size-based policy: ``FORCE_LEAF_MODULES``).
LEAF_MODULES = (nn.MultiheadAttention, )


def _resolves_options(resolver: Callable[..., Dict[str, Any]]) -> Callable:
    """Attach ``resolver(index, key, **options) -> options`` to a policy.

    It runs once, when the policy is built for a model (its :class:`ModelIndex`),
    to check the options against that model and turn names into the objects
    the predicate uses.
    """

    def attach(policy: Callable) -> Callable:
        policy.resolve_options = resolver
        return policy

    return attach


def _positive_int(value: Any, key: str) -> int:
    """A positive whole number, also written as a float (``1e7``, as OpenMMLab's configs do)."""
    whole = isinstance(value, int) or isinstance(value, float) and value.is_integer()
    if isinstance(value, bool) or not whole or value <= 0:
        raise ValueError(f'{key}: expected a positive whole number of parameters, got {value!r} '
                         '(a unit with no parameters shards nothing)')
    return int(value)


@FSDP_WRAP_POLICIES.register_module()
@_resolves_options(lambda index, key, min_num_params: dict(
    min_num_params=_positive_int(min_num_params, f'{key}.min_num_params')))
def size_based(module: nn.Module, recurse: bool, nonwrapped_numel: int,
               min_num_params: int) -> bool:
    """Make a unit of every module holding ``min_num_params`` not-yet-wrapped parameters."""
    if recurse:
        return nonwrapped_numel >= min_num_params or isinstance(module, _CONTAINERS)
    return nonwrapped_numel >= min_num_params and not isinstance(module, _CONTAINERS)


@FSDP_WRAP_POLICIES.register_module()
@_resolves_options(lambda index, key, layer_cls: dict(
    layer_cls=index.classes_of(layer_cls, f'{key}.layer_cls')))
def transformer(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                layer_cls: Tuple[Type[nn.Module], ...]) -> bool:
    """Make a unit of every instance of ``layer_cls`` (e.g. the transformer block)."""
    return module_types(module, recurse, nonwrapped_numel, module_cls=layer_cls)


@FSDP_WRAP_POLICIES.register_module()
@_resolves_options(lambda index, key, module_cls: dict(
    module_cls=index.classes_of(module_cls, f'{key}.module_cls')))
def module_types(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                 module_cls: Tuple[Type[nn.Module], ...]) -> bool:
    """Make a unit of every instance of ``module_cls`` (any module classes)."""
    return recurse or isinstance(module, module_cls)


@FSDP_WRAP_POLICIES.register_module()
@_resolves_options(lambda index, key, module_cls='auto': dict(
    module_cls=index.classes_of(module_cls, f'{key}.module_cls'),
    chosen=index.auto_blocks[1] if module_cls == 'auto' else 'the classes named'))
def auto(module: nn.Module, recurse: bool, nonwrapped_numel: int, module_cls: Any = 'auto',
         chosen: str = '') -> bool:
    """Make a unit of every instance of the model's blocks (none if nothing repeats).

    :attr:`ModelIndex.auto_blocks`: those its classes declare, else its repeated
    blocks; ``chosen`` says which, for the plan's log.
    """
    return module_types(module, recurse, nonwrapped_numel, module_cls=module_cls)


def _any_of(policies: Sequence[WrapPolicy]) -> WrapPolicy:

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return any(p(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
                   for p in policies)

    return policy


def _build_one(cfg: Any, index: ModelIndex, key: str) -> WrapPolicy:
    if isinstance(cfg, str):
        cfg = dict(type=cfg)
    if not isinstance(cfg, Mapping):
        if callable(cfg):
            return cfg
        raise TypeError(f'{key}: expected a policy name, dict(type=...), a callable or a list '
                        f'of those, got {type(cfg).__name__} {cfg!r}')
    options = {k: v for k, v in cfg.items() if k != 'type'}
    name = cfg.get('type')
    fn = name if callable(name) else FSDP_WRAP_POLICIES.get(name)
    if fn is None:
        names = sorted(FSDP_WRAP_POLICIES.module_dict)
        raise KeyError(f'{key}.type: {name!r} is not a registered wrap policy'
                       f'{suggest(name, names)}; registered policies are {names}')
    try:
        inspect.signature(fn).bind(index.model, True, 0, **options)
    except TypeError as e:
        params = list(inspect.signature(fn).parameters)[3:]
        raise TypeError(f'{key}: policy {name!r} {e}; its options are {params}') from None
    resolve = getattr(fn, 'resolve_options', None)
    if resolve is not None:
        options = resolve(index, key, **options)
    return functools.partial(fn, **options)


def build_wrap_policy(cfg: PolicyConfig, index: Union[ModelIndex, nn.Module],
                      key: str = 'model_wrapper_cfg.auto_wrap_policy') -> Union[WrapPolicy, None]:
    """Build the policy a config names, checked against the model of ``index``.

    Args:
        cfg: ``None`` (no auto-wrap: the whole model is one unit), a registered
            name, ``dict(type=name, **options)``, a callable, or a list of
            those (a module is wrapped if any of them says so).
        index: The unwrapped model the policy will be applied to, walked (or the model).
        key: The config key, for error messages.

    Raises:
        KeyError: unknown policy name (the message lists registered names).
        TypeError: unknown or missing policy option.
        ValueError: a class name the model does not contain.

    """
    if cfg is None:
        return None
    index = ModelIndex.of(index)
    if isinstance(cfg, (list, tuple)):
        if not cfg:
            raise ValueError(f'{key}: an empty list of policies wraps nothing; use None')
        return _any_of([_build_one(c, index, f'{key}[{i}]') for i, c in enumerate(cfg)])
    return _build_one(cfg, index, key)


def plan_units(index: Union[ModelIndex, nn.Module], policy: WrapPolicy) -> List[str]:
    """Names of the submodules ``policy`` makes units of, children before parents.

    Follows FSDP1's recursive wrapping: a module is looked into if the policy
    says ``recurse``; after its children, it becomes a unit if the policy
    accepts the parameters its children did not claim. The root is never in
    the list (it is always a unit). A parameter shared by several modules is
    counted once, where it is first reached. Nothing inside a :data:`LEAF_MODULES`
    instance is a unit (it may be one, whole).
    """
    index = ModelIndex.of(index)
    units: List[str] = []
    seen: set = set()

    def visit(module: nn.Module, name: str, is_root: bool) -> int:
        own = [p for p in index.below[name] if p not in seen]
        numel = sum(index.below[name][p] for p in own)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        claimed = 0
        children = () if isinstance(module, LEAF_MODULES) else module.named_children()
        for child_name, child in children:
            claimed += visit(child, f'{name}.{child_name}' if name else child_name, False)
        if not is_root and policy(module=module, recurse=False,
                                  nonwrapped_numel=numel - claimed):
            units.append(name)
            seen.update(own)
            return numel
        return claimed

    visit(index.model, '', True)
    return units


#: The name that stands for the root unit (the whole model) in a :class:`Merge`.
ROOT = '<root>'


@dataclass(frozen=True)
class Merge:
    """One resolution: ``dropped`` units give their parameters to ``owner``."""

    #: Names under which the shared parameter is registered.
    parameter_names: Tuple[str, ...]
    #: The units that would have held it.
    owners: Tuple[str, ...]
    #: Units that are no longer sharded separately.
    dropped: Tuple[str, ...]
    #: The unit (or :data:`ROOT`) that holds it now.
    owner: str


def innermost_unit(name: str, units: Sequence[str]) -> str:
    """The innermost of ``units`` enclosing module ``name``, or ``''`` for the root."""
    return max((unit for unit in units if within(name, unit)), key=len, default='')


def merge_units_sharing_parameters(index: Union[ModelIndex, nn.Module],
                                   units: Sequence[str]) -> Tuple[List[str], List[Merge]]:
    """Drop units so that every parameter belongs to exactly one unit or to the root.

    FSDP2 gives every parameter to one group, FSDP1 to one flat parameter (a
    shared one in two units fails in the forward: 'size mismatch'); a tied
    embedding / LM head is the classic case. The units that would hold a
    shared parameter give it to the innermost unit enclosing all of them;
    those between are not sharded separately. Dropping a unit never splits a
    parameter that was not split.

    Args:
        index: The unsharded model, walked (or the model).
        units: Names of the planned units, children before parents
            (:func:`mmfsdp.policies.plan_units`).

    Returns:
        The units to shard (same order, some dropped) and what was merged.
        Each merge is logged as a warning.

    """
    kept, merges = list(units), []
    for regs in ModelIndex.of(index).registrations.values():
        owners = {innermost_unit(module_name, kept) for _, module_name in regs}
        if len(owners) < 2:
            continue
        common = os.path.commonprefix([o.split('.') if o else [] for o in owners])
        owner = innermost_unit('.'.join(common), kept)
        dropped = tuple(u for u in kept if u != owner and within(u, owner)
                        and any(within(o, u) for o in owners))
        kept = [u for u in kept if u not in dropped]
        merge = Merge(parameter_names=tuple(name for name, _ in regs),
                      owners=tuple(sorted(o or ROOT for o in owners)),
                      dropped=dropped, owner=owner or ROOT)
        merges.append(merge)
        print_log(f'unit plan: parameter {" = ".join(merge.parameter_names)} is shared by '
                  f'{", ".join(merge.owners)}; a parameter belongs to one unit, so '
                  f'{", ".join(merge.dropped)} will not be sharded as separate units and '
                  f'their parameters join {merge.owner}', logger='current',
                  level=logging.WARNING)
    return kept, merges
