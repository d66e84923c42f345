"""``no_sync`` that follows ``model_wrapper_cfg.accumulation``, for FSDP1 and FSDP2.

mmengine's ``OptimWrapper.optim_context`` enters ``model.no_sync()`` on the
micro-steps of gradient accumulation, around the forward only: it runs the
backward after leaving the context. Whether a backward reduces is therefore
decided at forward time, as with DDP's ``no_sync``: :class:`AccumulationNoSync`
records the setting, and each wrapper applies it at its forward (FSDP1 to its
units' ``_sync_gradients``, FSDP2 to each root's ``set_requires_gradient_sync``,
:class:`GradientSyncSwitch`).

``no_sync`` follows ``model_wrapper_cfg.accumulation``
(:mod:`mmfsdp.options.accumulation`): with ``'sharded'`` it does nothing.
"""
import contextlib
from typing import Iterator, List, Union

from torch import nn

from ..options import Accumulation

__all__ = ['AccumulationNoSync', 'GradientSyncSwitch']


class AccumulationNoSync:
    """Mixin: ``no_sync`` sets whether the next forward's backward reduces gradients."""

    _accumulation: Accumulation = Accumulation.SHARDED
    #: Whether the backward of the next forward reduces gradients (False inside no_sync).
    _sync_next_backward: bool = True

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """What mmengine enters on accumulation micro-steps; follows ``accumulation``.

        ``'sharded'``: nothing, so each micro-step's backward reduce-scatters
        and adds to the gradient shards. ``'unsharded'``: forwards inside
        accumulate full local gradients in their backward, unreduced, until a
        backward of a forward outside; like DDP's ``no_sync``, the setting is
        taken at forward time and holds for that forward's backward, which
        mmengine runs after the context (FSDP1's and FSDP2's own switches are
        read in backward, so they would need the context around it).
        """
        if self._accumulation is Accumulation.SHARDED:
            yield
            return
        previous, self._sync_next_backward = self._sync_next_backward, False
        try:
            yield
        finally:
            self._sync_next_backward = previous


class GradientSyncSwitch(AccumulationNoSync):
    """Mixin for a wrapper of FSDP2 roots (``self._roots``, set by the subclass).

    FSDP2 roots have a switch (``set_requires_gradient_sync``) instead of a
    context manager; it is set from :meth:`no_sync`'s setting at each forward.
    """

    _roots: List[nn.Module]
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
            root.set_requires_gradient_sync(self._sync_next_backward)
            if self._keep_gathered:
                # the last micro-step (synced) reshards after its backward again
                root.set_reshard_after_backward(self._sync_next_backward)
