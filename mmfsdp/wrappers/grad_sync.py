"""``no_sync`` for FSDP2, which has a switch on each root instead of a context manager.

mmengine's ``OptimWrapper.optim_context`` enters ``model.no_sync()`` on the
micro-steps of gradient accumulation (as DDP and FSDP1 offer it). FSDP2 roots
have ``set_requires_gradient_sync``; the switch is read when a backward
reduces, and mmengine runs that backward after leaving the context, so the
wrapper records the setting here and applies it at each forward.
"""
import contextlib
from typing import Iterator, List

from torch import nn

__all__ = ['GradientSyncSwitch']


class GradientSyncSwitch:
    """Mixin for a wrapper of FSDP2 roots (``self._roots``, set by the subclass)."""

    _roots: List[nn.Module]
    _sync_gradients: bool = True

    def _apply_gradient_sync(self) -> None:
        """Called at forward: the coming backward reduces unless inside :meth:`no_sync`."""
        for root in self._roots:
            root.set_requires_gradient_sync(self._sync_gradients)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside accumulate gradients locally in their backward, unreduced.

        Like DDP's ``no_sync``, the setting is taken at forward time and holds
        for that forward's backward, which mmengine runs after the context.
        """
        previous, self._sync_gradients = self._sync_gradients, False
        try:
            yield
        finally:
            self._sync_gradients = previous
