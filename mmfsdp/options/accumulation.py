"""``accumulation``: where gradients live between the micro-steps of gradient accumulation.

With ``optim_wrapper.accumulative_counts = k > 1`` mmengine runs ``k`` forward /
backward micro-steps per optimizer step and, on all but the last, enters the
model's ``no_sync()``. The sharded wrappers read this option there:

- ``'sharded'`` (default): ``no_sync()`` does nothing; every micro-step
  reduce-scatters its gradients and adds them to this rank's gradient shard.
  Gradient memory stays at the ZeRO bound (P·b/N per rank); it costs k−1
  extra reduce-scatters per optimizer step.
- ``'unsharded'``: ``no_sync()`` keeps full, unreduced gradients of every
  parameter on every rank until the last micro-step (P·b per rank), which
  reduce-scatters once: the fewest collectives, the most memory.

Config::

    model_wrapper_cfg = dict(type='mmfsdp.MMFullyShard', accumulation='sharded')
"""
import enum
from typing import Union

from .common import suggest

__all__ = ['Accumulation', 'resolve_accumulation']


class Accumulation(enum.Enum):
    """Where gradients are accumulated across micro-steps."""

    #: Reduce-scatter every micro-step, accumulate into the gradient shard.
    SHARDED = 'sharded'
    #: Accumulate full local gradients (``no_sync``), reduce once per step.
    UNSHARDED = 'unsharded'


def resolve_accumulation(value: Union[str, Accumulation]) -> Accumulation:
    """``accumulation``: ``'sharded' | 'unsharded'`` (any case) or an :class:`Accumulation`."""
    if isinstance(value, Accumulation):
        return value
    choices = [m.value for m in Accumulation]
    if not isinstance(value, str):
        raise TypeError("model_wrapper_cfg.accumulation: expected 'sharded' or 'unsharded', "
                        f'got {type(value).__name__} {value!r}')
    try:
        return Accumulation(value.lower())
    except ValueError:
        raise ValueError(f'model_wrapper_cfg.accumulation: {value!r} is not valid'
                         f'{suggest(value.lower(), choices)}; valid choices are '
                         "'sharded' (reduce-scatter every micro-step; gradients stay sharded) "
                         "and 'unsharded' (no_sync: full gradients until the last micro-step)"
                         ) from None
