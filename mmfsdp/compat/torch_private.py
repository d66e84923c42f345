"""The private torch API mmfsdp relies on, each use with its reason."""
import contextlib
import dataclasses
import logging
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

# why: torch ships its activation-checkpoint wrapper only in this private module
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: F401
    ActivationWrapper,
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.fsdp import (
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardingStrategy,
)

# why: FSDP1 has no public reshard; its post-backward callback runs this one
from torch.distributed.fsdp._runtime_utils import _reshard

# why: the one base of BatchNorm1d/2d/3d and SyncBatchNorm is private
from torch.nn.modules.batchnorm import _BatchNorm as BATCH_NORM_BASE  # noqa: N811

# why: the one base of the norms with running statistics (batch and instance) is private
from torch.nn.modules.batchnorm import _NormBase as NORM_BASE  # noqa: N811

# why: the only way to see each aten operator a constructor or initialiser runs
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

from .version import parse_version

__all__ = ['ActivationWrapper', 'BATCH_NORM_BASE', 'fsdp1_fp32_classes', 'with_fsdp1_fp32_classes',
           'CHECKPOINT_WRAPPED_MODULE', 'CheckpointImpl', 'dcp_drops_names',
           'FSDP2_POLICY_PER_PARAMETER', 'FSDP_WRAPPED_MODULE', 'GLOO_WORKER_THREAD',
           'HYBRID_SHARD_ZERO2', 'NORM_BASE',
           'PRIVATE_INITIALISERS', 'TorchDispatchMode', 'apply_activation_checkpointing',
           'argument_names', 'checkpoint_inner', 'checkpoint_wrapper', 'compiled_modules',
           'convert_tensors',
           'direct_tensor', 'direct_tensors', 'dispatch_modes_off', 'fake_tensor_mode',
           'fsdp1_reshard_if_gathered', 'fsdp2_param_policies', 'full_precision',
           'gloo_worker_threads', 'initialiser', 'is_fake', 'operator_name', 'registered_buffers',
           'registered_child', 'registered_children', 'registered_parameters',
           'replace_registered', 'set_activation_memory_budget', 'set_fsdp1_gradient_sync',
           'set_fsdp2_param_policies',
           'storage_key', 'written_arguments']

#: The child name torch's FSDP1 gives the module it wraps.
FSDP_WRAPPED_MODULE = '_fsdp_wrapped_module'
#: The child name torch's activation-checkpoint wrapper gives the module it wraps.
CHECKPOINT_WRAPPED_MODULE = '_checkpoint_wrapped_module'

#: FSDP1's ZeRO-2 within a node, replicated across nodes.
HYBRID_SHARD_ZERO2 = ShardingStrategy._HYBRID_SHARD_ZERO2  # why: torch names it only privately

#: Initialiser names torch modules use besides ``reset_parameters`` (``nn.MultiheadAttention``).
PRIVATE_INITIALISERS = ('_reset_parameters', )


def initialiser(module: nn.Module) -> Optional[Callable[[], None]]:
    """``module.reset_parameters``, else its private ``_reset_parameters``; ``None`` if neither."""
    for name in ('reset_parameters', *PRIVATE_INITIALISERS):
        reset = getattr(module, name, None)  # why: torch's attention modules use the private name
        if callable(reset):
            return reset
    return None


def fsdp1_reshard_if_gathered(module: FullyShardedDataParallel) -> None:
    """Free an FSDP1 unit's gathered parameters, so a write into the shards is seen next forward."""
    handle = getattr(module, '_handle', None)  # why: FSDP1 keeps its FlatParamHandle privately
    if handle is None or not handle.uses_sharded_strategy:
        return
    flat_param = handle.flat_param
    # why: _full_param_padded is FSDP1's gathered buffer, allocated once the unit is sharded
    gathered = (not handle.is_sharded(flat_param)
                or hasattr(flat_param, '_full_param_padded') and not handle.needs_unshard())
    if gathered:
        _reshard(module, handle, free_unsharded_flat_param=True)


@contextlib.contextmanager
def full_precision(module: nn.Module) -> Iterator[None]:
    """Inside, the FSDP1 / FSDP2 units of ``module`` gather and compute in fp32, in eval mode.

    mmengine's AMP autocasts the training step only: its loops evaluate in full
    precision (an op such as mmcv's NMS refuses bf16). FSDP1 units in eval mode
    then use their full-precision flat parameters and take uncast inputs (torch's
    ``FSDP_USE_FULL_PREC_IN_EVAL``, set per unit); FSDP2 parameter groups gather
    without ``param_dtype`` and cast no inputs. Each side of the switch is entered
    resharded, so no gathered copy of the other dtype is used or kept; FSDP2's
    training-time unsharded parameters are set aside and put back, not remade, as
    between micro-steps without gradient sync they hold the accumulated gradient.
    """
    fsdp1 = FullyShardedDataParallel.fsdp_modules(module)
    fsdp2 = [m for m in module.modules() if isinstance(m, FSDPModule)]
    # why: FSDP1 reads this flag on each unit's state (inputs) and handle (parameters)
    flags = [(o, o._use_full_prec_in_eval) for u in fsdp1 for o in (u, u._handle)
             if o is not None]
    # why: FSDP2 keeps the dtypes of a group's parameters privately (FSDPParam.param_dtype,
    # from their policies: fsdp2_param_policies) and casts forward inputs by its state's
    # _mp_policy; grouped fully_shard shares one state
    states = list({id(s): s for s in (m._get_fsdp_state() for m in fsdp2)}.values())
    groups = [g for s in states for g in s._fsdp_param_groups]
    policies = [s._mp_policy for s in states], [fsdp2_param_policies(g) for g in groups]
    # id(FSDPParam) -> its training-time gathered buffers, set aside while evaluating
    training_buffers: Dict[int, Tuple[List[torch.Tensor], Optional[nn.Parameter]]] = {}

    def switch(full: Optional[bool], state_policies: List[Any], group_policies: List[Any]) -> None:
        for unit in fsdp1:
            fsdp1_reshard_if_gathered(unit)
        for unit in fsdp2:
            unit.reshard()
        for (owner, flag) in flags:
            owner._use_full_prec_in_eval = flag if full is None else full
        for state, policy in zip(states, state_policies):
            state._mp_policy = policy
        for group, policy in zip(groups, group_policies):
            set_fsdp2_param_policies(group, policy)  # lazy init (a first forward in eval) reads it
            for param, own in zip(group.fsdp_params, policy):
                param.init_dtype_attrs(own)
                # why: the gathered buffers are made once, in param_dtype: evaluation makes
                # its own, and training gets its own back, since between micro-steps without
                # gradient sync FSDP2 accumulates the unsharded gradient on that parameter
                buffers = param.all_gather_outputs, vars(param).pop('_unsharded_param', None)
                param.all_gather_outputs, unsharded = training_buffers.pop(id(param), ([], None))
                if unsharded is not None:
                    param._unsharded_param = unsharded
                if full:
                    training_buffers[id(param)] = buffers

    def fp32(policy: Any) -> Any:
        return dataclasses.replace(policy, param_dtype=None, output_dtype=None)

    switch(True, [fp32(p) for p in policies[0]], [[fp32(p) for p in ps] for ps in policies[1]])
    try:
        yield
    finally:
        switch(None, *policies)


#: Whether each FSDP2 ``FSDPParam`` holds the policy lazy init reads (torch 2.15); before, its
#: ``FSDPParamGroup`` held one ``mp_policy`` for all (torch 2.13, 2.14).
FSDP2_POLICY_PER_PARAMETER = parse_version(torch.__version__) >= (2, 15)


def fsdp2_param_policies(group: Any) -> List[Any]:
    """The ``MixedPrecisionPolicy`` of each parameter of an FSDP2 ``FSDPParamGroup``, in order.

    torch 2.15 resolves one per parameter (``param_dtype_override_fn``); before,
    each parameter's is its group's.
    """
    # why: FSDPParam keeps the policy it was made with as mp_policy (2.13 to 2.15)
    return [param.mp_policy for param in group.fsdp_params]


def set_fsdp2_param_policies(group: Any, policies: List[Any]) -> None:
    """Give the parameters of an FSDP2 group ``policies`` (one each), where lazy init reads them."""
    for param, policy in zip(group.fsdp_params, policies):
        param.mp_policy = policy  # why: 2.15's lazy init reads each FSDPParam's mp_policy
    if not FSDP2_POLICY_PER_PARAMETER and policies:
        # why: 2.13 / 2.14's lazy init reads the group's mp_policy (the same for every parameter)
        group.mp_policy = policies[0]


def set_fsdp1_gradient_sync(module: FullyShardedDataParallel, sync: bool) -> None:
    """Whether this FSDP1 unit's next backward reduces gradients."""
    # why: the flag no_sync toggles, read in backward; mmengine leaves no_sync before backward
    module._sync_gradients = sync


def fsdp1_fp32_classes(mixed_precision: MixedPrecision) -> Tuple[type, ...]:
    """The module classes an FSDP1 ``MixedPrecision`` keeps in full precision."""
    # why: FSDP1 names the field privately (experimental) in its public dataclass
    return tuple(mixed_precision._module_classes_to_ignore)


def with_fsdp1_fp32_classes(mixed_precision: MixedPrecision,
                            classes: Tuple[type, ...]) -> MixedPrecision:
    """``mixed_precision`` keeping exactly ``classes`` in full precision."""
    return dataclasses.replace(mixed_precision, _module_classes_to_ignore=classes)


def compiled_modules(module: nn.Module) -> Tuple[str, ...]:
    """Names of the submodules of ``module`` whose calls ``nn.Module.compile`` compiled."""
    # why: Module.compile keeps the compiled call only in this private attribute
    return tuple(name for name, m in module.named_modules()
                 if getattr(m, '_compiled_call_impl', None) is not None)


def set_activation_memory_budget(budget: float) -> None:
    """Let torch.compile's partitioner keep at most ``budget`` of a graph's activations (0 to 1)."""
    import torch._functorch.config as functorch_config

    # why: torch exposes the memory-budget partitioner only as this private config (2.4+)
    functorch_config.activation_memory_budget = budget


def checkpoint_inner(module: nn.Module) -> Optional[nn.Module]:
    """The module an activation-checkpoint wrapper wraps; ``None`` for any other module."""
    if not isinstance(module, ActivationWrapper):
        return None
    return module._modules[CHECKPOINT_WRAPPED_MODULE]  # why: the wrapper's only child


def dcp_drops_names(cls: type) -> type:
    """Class decorator: DCP names ``cls``'s state without what ``dropped_name_components`` lists.

    ``cls.dropped_name_components(self) -> {child name: component}`` says which
    components state-dict keys leave out.
    """
    # why: DCP's private hook (torch >= 2.7); without it DCP expects 'module.'-prefixed keys
    cls._fqn_modifiers = lambda self: self.dropped_name_components()
    return cls


def convert_tensors(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Replace every parameter and buffer ``t`` of ``module`` by ``fn(t)``, in place."""
    # why: the walk behind Module.to (keeps Parameters); to_empty would empty real tensors too
    module._apply(fn)


def registered_children(module: nn.Module) -> List[Tuple[str, Optional[nn.Module]]]:
    """``module``'s children as registered (``None`` slots included)."""
    # why: the real tree; a wrapper may override named_children / get_submodule to rename
    return list(module._modules.items())


def registered_child(module: nn.Module, name: str) -> nn.Module:
    """The child registered as ``name`` (see :func:`registered_children`)."""
    return module._modules[name]


def registered_parameters(module: nn.Module) -> List[Tuple[str, Optional[nn.Parameter]]]:
    """``module``'s own parameters as registered (``None`` slots included)."""
    # why: named_parameters skips None slots and shared tensors; a wrapper may rename them
    return list(module._parameters.items())


def registered_buffers(module: nn.Module) -> List[Tuple[str, Optional[torch.Tensor]]]:
    """``module``'s own buffers as registered (as :func:`registered_parameters`)."""
    return list(module._buffers.items())  # why: as registered_parameters


def direct_tensors(module: nn.Module) -> List[Tuple[str, Optional[torch.Tensor]]]:
    """``module``'s own parameters then buffers, as registered (``None`` slots included)."""
    return [*registered_parameters(module), *registered_buffers(module)]


def direct_tensor(module: nn.Module, name: str) -> Optional[torch.Tensor]:
    """The parameter or buffer ``module`` registered as ``name`` (``None`` if none)."""
    return dict(direct_tensors(module)).get(name)


def replace_registered(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Swap the parameter or buffer registered as ``name`` for ``tensor``, registering nothing."""
    # why: setattr would run registration hooks and type checks again for a filled slot
    if name in module._parameters:
        module._parameters[name] = tensor
    else:
        module._buffers[name] = tensor


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` that turns real CPU inputs into fake tensors on first use."""
    # why: only fake tensors (torch._subclasses) run forward and backward without storage
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (shapes without storage)."""
    from torch._subclasses.fake_tensor import is_fake as fake  # why: as fake_tensor_mode
    return fake(tensor)


def dispatch_modes_off() -> Any:
    """A context in which no dispatch mode (fake tensors, counters) is active: real tensors."""
    # why: torch's only way to step out of every active TorchDispatchMode and back
    from torch.utils._python_dispatch import _disable_current_modes
    return _disable_current_modes()


def storage_key(tensor: torch.Tensor) -> int:
    """A key equal for tensors that share storage, also on the meta device."""
    return tensor.untyped_storage()._cdata  # why: data_ptr() is 0 for every meta storage


def written_arguments(func: Any) -> List[str]:
    """Names of the arguments an aten operator (``OpOverload``) writes into."""
    # why: an OpOverload exposes which arguments it mutates only through its _schema
    return [a.name for a in func._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write]


def operator_name(func: Any) -> str:
    """An aten operator's name without its overload (``'aten::empty'``)."""
    return func._schema.name  # why: as written_arguments


def argument_names(func: Any) -> List[str]:
    """Names of an aten operator's arguments, in order."""
    return [a.name for a in func._schema.arguments]  # why: as written_arguments


#: The name torch gives the worker threads of a gloo process group (``ProcessGroupGloo::runLoop``).
GLOO_WORKER_THREAD = 'pt_gloo_runloop'


def gloo_worker_threads() -> List[int]:
    """The thread ids of this process's gloo worker threads (Linux; elsewhere none)."""
    # why: torch exposes neither the threads nor a way to wait for them; found by their name
    task_dir = f'/proc/{os.getpid()}/task'
    if not os.path.isdir(task_dir):
        return []
    found = []
    for tid in os.listdir(task_dir):
        try:
            with open(f'{task_dir}/{tid}/comm') as f:
                if f.read().strip() == GLOO_WORKER_THREAD:
                    found.append(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return found


# ---- DCP's file-system reader: mmfsdp reads ``.metadata`` with an allow-listed unpickler ----

__all__ += ['dcp_metadata_path', 'dcp_metadata_private_globals', 'load_whole_dcp']


def dcp_metadata_path(reader: Any, rank: Optional[int] = None) -> Any:
    """The ``.metadata`` file a DCP ``FileSystemReader`` reads (with ``rank``: the rank's own)."""
    # why: FileSystemReader names its metadata file (``_metadata_fn``) only in this private method
    return reader._get_metadata_path(rank)


def dcp_metadata_private_globals() -> Tuple[Any, ...]:
    """The private torch names that DCP's ``FileSystemWriter`` pickles into every ``.metadata``."""
    # why: the metadata unpickler's allow-list must name them; torch has them only privately
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # storage_data's values
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING  # TensorProperties
    from torch.serialization import _get_layout  # how a torch.layout (torch.strided) is pickled
    return _StorageInfo, _MEM_FORMAT_ENCODING, _get_layout


__all__ += ['dcp_tensor_properties']


class _TensorPropertiesOfNewerTorch(TensorProperties):
    """Reads DCP's ``TensorProperties`` from a newer torch's pickle into this torch's class."""

    def __setstate__(self, state: Tuple[Any, ...]) -> None:
        # why: TensorProperties pickles its fields as a positional tuple (__getstate__), in
        # torch 2.13 to 2.15 in this order, 2.15 appending strides
        super().__setstate__(tuple(state)[:5])
        self.__class__ = TensorProperties  # equal to, and pickled as, what torch reads itself


def dcp_tensor_properties() -> type:
    """The class a DCP ``.metadata``'s ``TensorProperties`` is read as under this torch.

    torch 2.15 pickles a sixth field, ``strides`` (recorded; its loader reads
    bytes by ``sizes`` alone), and reads five or six. torch 2.13 / 2.14's
    ``__setstate__`` unpacks exactly five and fails on a 2.15 checkpoint (``too
    many values to unpack (expected 5)``): there, a subclass that drops the sixth
    and leaves a plain ``TensorProperties``.
    """
    if 'strides' in {f.name for f in dataclasses.fields(TensorProperties)}:
        return TensorProperties
    return _TensorPropertiesOfNewerTorch


def load_whole_dcp(reader: Any) -> Dict[str, Any]:
    """Every entry of a DCP checkpoint, nested as saved, read in this process through ``reader``."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # why: what dcp_to_torch_save does, which builds its own FileSystemReader (plain pickle)
    state: Dict[str, Any] = {}
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state


# ---- DCP's staging: a DTensor whose local part is a copy on another device ----

__all__ += ['dtensor_like']


def dtensor_like(dtensor: Any, local: torch.Tensor) -> Any:
    """A ``DTensor`` laid out as ``dtensor`` (mesh, placements, shape) holding ``local``.

    ``local`` may be on another device than the mesh's: a CPU copy of an
    accelerator's shard, as DCP's own stager makes them for ``async_save``.
    """
    from torch.distributed.tensor import DTensor

    # why: DTensor.from_local moves ``local`` to the mesh's device; DCP's stager builds this way
    return DTensor(local, dtensor._spec, requires_grad=False)


# ---- torch.compile's limit of graphs per compiled function, and its report when reached ----

__all__ += ['default_recompile_limit', 'on_recompile_limit']


def default_recompile_limit() -> int:
    """How many graphs ``torch.compile`` keeps per compiled function unless told (8 in 2.13)."""
    import torch._dynamo.config as dynamo_config

    # why: torch.compile's recompile_limit=None reads this private config
    return dynamo_config.recompile_limit


class _RecompileLimitHits(logging.Handler):
    """Hands each report of a reached recompile limit to every callback (one handler a process)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.callbacks: List[Callable[[str], None]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith('torch._dynamo hit config.'):
            message = record.getMessage().split('\nTo log all')[0]
            for callback in self.callbacks:
                callback(message)


def on_recompile_limit(callback: Callable[[str], None]) -> None:
    """Call ``callback(message)`` when a compiled function reaches its recompile limit.

    Past it, torch runs the function eager for inputs no graph fits; ``message``
    (torch's words) names the limit, the function and the guard that failed last.
    """
    # why: dynamo reports a reached limit only as this warning of its private module's logger
    logger = logging.getLogger('torch._dynamo.convert_frame')
    handler = next((h for h in logger.handlers if isinstance(h, _RecompileLimitHits)), None)
    if handler is None:
        handler = _RecompileLimitHits()
        logger.addHandler(handler)
    if callback not in handler.callbacks:
        handler.callbacks.append(callback)


__all__ += ['fsdp2_lazy_init']


def fsdp2_lazy_init(module: nn.Module) -> None:
    """Make ``module`` (an FSDP2 root) the root of its units, as its first forward would."""
    # why: FSDP2 makes the first module to run forward the root; a hook that calls a unit
    # (model.generate before the first training step) would otherwise become one
    module._get_fsdp_state()._lazy_init()
