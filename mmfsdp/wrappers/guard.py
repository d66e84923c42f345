"""Refuse to be built by mmengine's stock ``Runner.wrap_model``.

The stock Runner initialises and broadcasts weights *after* wrapping, builds
the optimizer on flattened shards and clips by a per-shard norm: with a sharded
model that aborts in gloo, hangs, or silently trains something else. A sharded
wrapper therefore fails at construction, before any collective, and says what
to use instead.
"""
import sys

from mmengine.runner import Runner

__all__ = ['reject_stock_runner']

_STOCK_WRAP_MODEL = Runner.wrap_model.__code__


def reject_stock_runner(wrapper_name: str) -> None:
    """Raise ``RuntimeError`` if the caller is mmengine's own ``Runner.wrap_model``.

    ``FSDPRunner`` builds sharded wrappers itself, so the stock code object is
    on the stack only when the stock method (or a subclass that defers to it)
    is wrapping the model.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _STOCK_WRAP_MODEL:
            raise RuntimeError(
                f"{wrapper_name} cannot be used with mmengine's stock Runner, which "
                'initialises weights after sharding, groups parameters by their shards and '
                "clips by per-shard norms; set runner_type='mmfsdp.FSDPRunner' in the config")
        frame = frame.f_back
