"""The :class:`~mmfsdp.protocol.ParallelWrapper` members a resolved config answers."""
from typing import Any, ClassVar, Mapping, Optional, Type

from torch import nn

from ..protocol import ParallelWrapper
from .config import WrapperConfig

__all__ = ['ConfiguredWrapper']


class ConfiguredWrapper(ParallelWrapper):
    """Base of the sharded wrappers: config checks and offload answered by :attr:`CONFIG`."""

    #: The frozen dataclass the wrapper's keyword arguments resolve into.
    CONFIG: ClassVar[Type[WrapperConfig]]
    #: The wrapper's name in configs and errors (``'mmfsdp.<Class>'``).
    NAME: ClassVar[str]

    @classmethod
    def check_config(cls, config: Mapping[str, Any], module: Optional[nn.Module] = None) -> None:
        """Raise on a bad config; with ``module``, check the model-dependent options too.

        Lets a runner reject a config on every rank before any collective.
        """
        cls.CONFIG.check(config, module, cls.NAME)

    @classmethod
    def offloads_to_cpu(cls, config: Mapping[str, Any]) -> bool:
        """Whether ``config`` keeps the parameters on the CPU."""
        return cls.CONFIG.from_dict(config).offloads_to_cpu
