"""``no_sync`` for FSDP2, which has a switch on each root instead of a context manager.

mmengine's ``OptimWrapper.optim_context`` enters ``model.no_sync()`` on the
micro-steps of gradient accumulation (as DDP and FSDP1 offer it). FSDP2 roots
have ``set_requires_gradient_sync``; the switch is read when a backward
reduces, and mmengine runs that backward after leaving the context, so the
wrapper records the setting here and applies it at each forward.

``no_sync`` follows ``model_wrapper_cfg.accumulation``
(:mod:`mmfsdp.options.accumulation`): with ``'sharded'`` it does nothing.
"""
import contextlib
from typing import Iterator, List, Union

from torch import nn

from ..options import Accumulation

__all__ = ['GradientSyncSwitch']


class GradientSyncSwitch:
    """Mixin for a wrapper of FSDP2 roots (``self._roots``, set by the subclass)."""

    _roots: List[nn.Module]
    _sync_gradients: bool = True
    _accumulation: Accumulation = Accumulation.SHARDED
    #: Keep the gathered parameters through the micro-steps under no_sync.
    _keep_gathered: bool = False

    def _set_accumulation(self, accumulation: Accumulation,
                          reshard_after_forward: Union[bool, int]) -> None:
        """Set the ``accumulation`` mode, called once by the wrapper.

        ZeRO-2 (``reshard_after_forward=False``) asks to keep parameters gathered
        from forward to backward, so ``'unsharded'`` then keeps them across micro-steps.
        """
        self._accumulation = accumulation
        self._keep_gathered = (accumulation is Accumulation.UNSHARDED
                               and reshard_after_forward is False)

    def _apply_gradient_sync(self) -> None:
        """Called at forward: the coming backward reduces unless inside :meth:`no_sync`."""
        for root in self._roots:
            root.set_requires_gradient_sync(self._sync_gradients)
            if self._keep_gathered:
                # the last micro-step (synced) reshards after its backward again
                root.set_reshard_after_backward(self._sync_gradients)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """What mmengine enters on accumulation micro-steps; follows ``accumulation``.

        ``'sharded'``: nothing, so each micro-step's backward reduce-scatters
        and adds to the gradient shards. ``'unsharded'``: forwards inside
        accumulate gradients locally in their backward, unreduced; like DDP's
        ``no_sync``, the setting is taken at forward time and holds for that
        forward's backward, which mmengine runs after the context.
        """
        if self._accumulation is Accumulation.SHARDED:
            yield
            return
        previous, self._sync_gradients = self._sync_gradients, False
        try:
            yield
        finally:
            self._sync_gradients = previous
