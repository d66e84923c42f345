"""What must have happened before :class:`mmfsdp.FSDPRunner` wraps the model in ``train()``.

The runner wraps inside ``load_or_resume()``, relying on the order of
mmengine's ``Runner.train()``: build the optim wrapper, ``before_run`` hooks,
``_init_model_weights()`` (initialise, broadcast rank 0's weights), then
``load_or_resume()``. Wrapping earlier would build the optimizer on shards (or
not point it at them) and shard weights that are not final yet, with no error.
:class:`WrapPreconditions` records what ``train()`` has done and turns a
changed order (a new mmengine release, a runner subclass) into an error on
every rank, before the wrapper's first collective.
"""
import contextlib
from typing import Iterator, List, Optional

from .optim_wrappers import is_built

__all__ = ['LifecycleError', 'WrapPreconditions']


class LifecycleError(RuntimeError):
    """The runner reached wrapping in an order that would train the wrong thing."""


class WrapPreconditions:
    """The steps of ``Runner.train()`` done so far, checked where the model is wrapped."""

    def __init__(self) -> None:
        self._phase: Optional[str] = None
        self._weights_ready = False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Within ``name`` (``'train'``), :meth:`check` applies."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    def weights_ready(self) -> None:
        """Record that the weights are initialised and the same on every rank."""
        self._weights_ready = True

    def check(self, optim_wrapper: object) -> None:
        """Raise :class:`LifecycleError` if ``train()`` wraps before its preconditions hold."""
        if self._phase != 'train':
            return  # val() / test(): the weights come from load_from, no optimizer
        missing: List[str] = []
        if not is_built(optim_wrapper):
            missing.append('the optim wrapper is not built yet (build_optim_wrapper runs '
                           'first, on the unwrapped model)')
        if not self._weights_ready:
            missing.append('the weights are not initialised yet (_init_model_weights runs '
                           'first: initialise, then broadcast rank 0\'s weights)')
        if missing:
            raise LifecycleError(
                'FSDPRunner.train() reached wrapping the model (load_or_resume) too early: '
                + '; '.join(missing) + '. FSDPRunner relies on the order of mmengine\'s '
                'Runner.train() (0.10.x): build_optim_wrapper, before_run, '
                '_init_model_weights, load_or_resume; a runner subclass or an mmengine '
                'version that reorders them must keep that order')
