"""Models that run their own steps: each child with parameters is sharded as its own root.

A model that defines ``train_step`` / ``val_step`` / ``test_step`` itself (a
GAN updating a generator and a discriminator with an ``OptimWrapperDict``,
``BaseTTAModel`` calling ``self.module.test_step``) calls its sub-modules
directly, so the wrapper's own forward never runs. FSDP gathers parameters
only in the forward of a sharded module, and reduces gradients in the backward
of that forward; so each top-level child that holds parameters becomes an FSDP
root of its own (as mmengine's ``MMSeparateDistributedDataParallel`` gives each
child its own DDP), and every forward the model runs through a child gathers
that child. Parameters held by the model itself, outside any child, would
never be gathered: such a model is refused when it is wrapped.

Config (unchanged: the wrapper sees the model's own steps)::

    model_wrapper_cfg = dict(type='mmfsdp.MMFullyShard')                 # FSDP2
    model_wrapper_cfg = dict(type='mmfsdp.MMFullyShardedDataParallel')   # FSDP1
"""
import contextlib
from typing import Any, Iterator, List

from torch import nn

from ..registry import MODEL_WRAPPERS
from .holder import ModelHolder
from .steps import DataParallelSteps, own_steps

__all__ = ['MMSeparateFullyShardedDataParallel', 'separate_roots']


def separate_roots(module: nn.Module, wrapper: str) -> List[str]:
    """The top-level children of ``module`` that hold parameters, for a model with own steps.

    Raises ``ValueError`` (the same on every rank, before any collective) when
    the model holds parameters itself or has no child with parameters.
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
             if next(child.parameters(), None) is not None]
    if not roots:
        raise ValueError(f'model_wrapper_cfg.type={wrapper!r}: {model} has no child module '
                         'with parameters to shard')
    return roots


@MODEL_WRAPPERS.register_module()
class MMSeparateFullyShardedDataParallel(DataParallelSteps, ModelHolder):
    """FSDP1 for a model with its own steps: each child with parameters is its own FSDP1 root.

    ``mmfsdp.MMFullyShardedDataParallel`` builds this for such a model; the
    keyword arguments are its options, applied to every child (the wrap policy
    and activation checkpointing work inside each child). Each child becomes an
    ``MMFullyShardedDataParallel``, so a child's own ``test_step`` (as
    ``BaseTTAModel`` calls it) also runs through FSDP.

    Config::

        model_wrapper_cfg = dict(type='mmfsdp.MMFullyShardedDataParallel',
                                 auto_wrap_policy=dict(type='size_based', min_num_params=1e6))
    """

    def __init__(self, module: nn.Module, **config: Any) -> None:
        # By name: MMFullyShardedDataParallel builds this class (no import cycle).
        root_cls = MODEL_WRAPPERS.get('MMFullyShardedDataParallel')
        super().__init__()
        for name in separate_roots(module, 'mmfsdp.MMFullyShardedDataParallel'):
            module.register_module(name, root_cls(module.get_submodule(name), **config))
        self.module = module

    def roots(self) -> List[nn.Module]:
        """The FSDP1 roots, one per child with parameters."""
        return [m for m in self.module.children() if isinstance(m, DataParallelSteps)]

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
