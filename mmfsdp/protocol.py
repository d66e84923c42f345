"""The interfaces between mmfsdp's wrappers and the code that drives them.

:class:`ParallelWrapper` is everything :class:`mmfsdp.FSDPRunner`, the
optimizer set-up (:mod:`mmfsdp.optim`), mmengine's ``OptimWrapper``, the plan
(:mod:`mmfsdp.plan`), the rank agreement (:mod:`mmfsdp.agreement`) and meta
init (:mod:`mmfsdp.meta_init`) ask of a model wrapper. FSDP1
(:class:`mmfsdp.MMFullyShardedDataParallel`), FSDP2 (:class:`mmfsdp.MMFullyShard`)
and DDP (:class:`mmfsdp.MMDistributedDataParallel`) subclass it; a new wrapper
does the same and registers itself in :data:`mmfsdp.registry.MODEL_WRAPPERS`
(see "Adding a wrapper" in the README). Consumers test
:func:`is_parallel_wrapper` once and then call the members; a wrapper that is
not one (mmengine's ``MMDistributedDataParallel``, a third-party wrapper) is
driven as mmengine drives it.

:class:`ModelBinding` is the one thing the runner asks of an optim wrapper
beyond mmengine's: to be told which wrapped model it steps.
"""
import abc
from typing import (
    TYPE_CHECKING,
    Any,
    ClassVar,
    ContextManager,
    Dict,
    Mapping,
    Optional,
    Protocol,
    runtime_checkable,
)

import torch
from torch import nn

if TYPE_CHECKING:  # the plan imports wrappers' specs; only the annotation is needed here
    from .plan.spec import ShardingSpec

__all__ = ['ModelBinding', 'ParallelWrapper', 'is_parallel_wrapper']


class ParallelWrapper(abc.ABC):
    """What an mmfsdp model wrapper offers the runner, optimizer, checkpoint and plan code.

    A wrapper is an ``nn.Module`` that holds the model as ``self.module``
    (mmengine's wrapper contract, which ``is_model_wrapper`` and the stock
    hooks rely on) and is built as ``Wrapper(module, **options)`` from
    ``model_wrapper_cfg``. Class-level members answer questions about a
    *config* before anything is built (on every rank, before any collective);
    instance members serve training.

    Example::

        @MODEL_WRAPPERS.register_module()
        class MyWrapper(DataParallelSteps, nn.Module, ParallelWrapper):
            def __init__(self, module, **options): ...
            @classmethod
            def check_config(cls, config, module=None): ...
            @classmethod
            def sharding_spec(cls, config, module, world_size): ...
            def no_sync(self): ...
            def clip_grad_norm_(self, max_norm, norm_type=2.0): ...
    """

    #: The wrapped model (mmengine's wrapper contract).
    module: nn.Module

    #: Whether the wrapper materialises a model built on the meta device
    #: (``init_device='meta'`` in its config): :class:`mmfsdp.FSDPRunner` then
    #: builds the model there and wraps it at once (:mod:`mmfsdp.meta_init`).
    supports_meta_init: ClassVar[bool] = False

    @classmethod
    @abc.abstractmethod
    def check_config(cls, config: Mapping[str, Any], module: Optional[nn.Module] = None) -> None:
        """Raise on a bad config (the options, without ``type``), naming the key and the fix.

        Called on every rank before the process group starts (``module`` is
        ``None``) and again with the built model, before the first collective
        that depends on it, so a mistake is one error everywhere, not a hang.
        """

    @classmethod
    @abc.abstractmethod
    def sharding_spec(cls, config: Mapping[str, Any], module: nn.Module,
                      world_size: int) -> 'ShardingSpec':
        """How ``config`` shards ``module`` over ``world_size`` ranks, without sharding.

        The input of the memory plan (:mod:`mmfsdp.plan`) and part of the
        fingerprint the ranks compare before wrapping (:mod:`mmfsdp.agreement`).
        """

    @classmethod
    def offloads_to_cpu(cls, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` keeps the parameters on the CPU while training.

        The process group then needs a CPU backend beside the accelerator's
        (:func:`mmfsdp.dist.init_distributed`). Default: no.
        """
        return False

    @classmethod
    def stages_on_cpu(cls, config: Mapping[str, Any], device: torch.device) -> bool:
        """Whether the runner keeps the model on the CPU until wrapping, for ``device``.

        If so, the runner initialises the weights on rank 0's CPU copy only
        and builds the wrapper with ``sync_module_states=True``: the wrapper
        moves the model to the device and broadcasts rank 0's weights itself,
        unit by unit, so no device ever holds the full model. Default: no (the
        runner moves the model to the device and broadcasts the weights).
        """
        return False

    @abc.abstractmethod
    def no_sync(self) -> ContextManager[None]:
        """Within the context, backward accumulates gradients locally, unreduced.

        mmengine's ``OptimWrapper.optim_context`` enters it on the micro-steps
        of gradient accumulation, so gradients are reduced once per step.
        """

    @abc.abstractmethod
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so that their norm over all ranks is at most ``max_norm``.

        Collective: every rank calls it. Returns the norm before clipping.
        """

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


@runtime_checkable
class ModelBinding(Protocol):
    """An optim wrapper that needs to know the wrapped model it steps.

    :class:`mmfsdp.FSDPRunner` calls :meth:`bind_model` on each such optim
    wrapper once the model is wrapped (e.g. :class:`mmfsdp.AmpOptimWrapper`
    picks a gradient scaler that agrees across shards). Structural: any optim
    wrapper with this method is one.
    """

    def bind_model(self, model: nn.Module) -> None:
        """Adapt to ``model``, the wrapped model; called once wrapping is done (idempotent)."""
