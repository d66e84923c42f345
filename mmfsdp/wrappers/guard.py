"""Refuse to be built by mmengine's stock ``Runner`` or by its ``FlexibleRunner``.

The stock Runner initialises and broadcasts weights *after* wrapping, builds
the optimizer on flattened shards and clips by a per-shard norm: with a sharded
model that aborts in gloo, hangs, or silently trains something else.
``FlexibleRunner`` wraps through a strategy (``DDPStrategy`` passes
``device_ids``, mmengine's ``FSDPStrategy`` its own FSDP1 options) with the same
ordering problems. A sharded wrapper therefore fails at construction, before
any collective, and says what to use instead.

Why the call stack: neither runner offers a hook that runs before it builds
the wrapper, and both call the constructor exactly as a user building the
wrapper by hand does, so the builder can only be told apart by who is calling.
"""
from typing import Optional

from mmengine.runner import FlexibleRunner, Runner

from ..compat import call_stack

__all__ = ['reject_stock_runner']

_STOCK_WRAP_MODEL = Runner.wrap_model.__code__


#: What each refused runner gets wrong under sharding.
_WHY = {
    'Runner': "mmengine's stock Runner, which initialises weights after sharding, groups "
              'parameters by their shards and clips by per-shard norms',
    'FlexibleRunner': "mmengine's FlexibleRunner, whose strategies build the optimizer on the "
                      'shards and clip by per-shard norms',
}


def _refusing_runner() -> Optional[str]:
    """Which refused runner builds the wrapper, looking from the caller outwards (or ``None``)."""
    for frame in call_stack():
        if frame.f_code is _STOCK_WRAP_MODEL:
            return 'Runner'
        if isinstance(frame.f_locals.get('self'), FlexibleRunner):
            return 'FlexibleRunner'
    return None


def reject_stock_runner(wrapper_name: str) -> None:
    """Raise ``RuntimeError`` if mmengine's ``Runner.wrap_model`` or a ``FlexibleRunner`` calls.

    ``FSDPRunner`` builds sharded wrappers itself, so the stock code object is
    on the stack only when the stock method (or a subclass that defers to it)
    is wrapping the model; a ``FlexibleRunner`` method on the stack is building
    it through its strategy.
    """
    runner = _refusing_runner()
    if runner is not None:
        raise RuntimeError(
            f'{wrapper_name} cannot be used with {_WHY[runner]}; set '
            "runner_type='mmfsdp.FSDPRunner' in the config"
            + (' (with model_wrapper_cfg instead of strategy)' if runner != 'Runner' else ''))
