"""The one way to walk the optim wrapper(s) a runner holds.

mmengine's runner holds an ``OptimWrapper`` or an ``OptimWrapperDict`` (one
wrapper per optimizer, e.g. a GAN's generator and discriminator). Everything
that acts per optimizer (retargeting parameters, clipping, AMP binding,
checkpoint state) walks them with :func:`named_optim_wrappers`.
"""
from typing import Iterator, Optional, Tuple, Union

from mmengine.optim import OptimWrapper, OptimWrapperDict

__all__ = ['AnyOptimWrapper', 'is_built', 'named_optim_wrappers', 'optim_wrappers']

#: What ``runner.optim_wrapper`` holds once built.
AnyOptimWrapper = Union[OptimWrapper, OptimWrapperDict]


def named_optim_wrappers(
        optim_wrapper: AnyOptimWrapper) -> Iterator[Tuple[Optional[str], OptimWrapper]]:
    """``(None, wrapper)`` for one optim wrapper, ``(name, wrapper)`` for each of a dict."""
    if isinstance(optim_wrapper, OptimWrapperDict):
        yield from optim_wrapper.optim_wrappers.items()
    else:
        yield None, optim_wrapper


def optim_wrappers(optim_wrapper: AnyOptimWrapper) -> Iterator[OptimWrapper]:
    """Each ``OptimWrapper`` of one wrapper or of a dict of them."""
    for _, wrapper in named_optim_wrappers(optim_wrapper):
        yield wrapper


def is_built(optim_wrapper: object) -> bool:
    """Whether ``runner.optim_wrapper`` is built (mmengine holds the config dict until then)."""
    return isinstance(optim_wrapper, (OptimWrapper, OptimWrapperDict))
