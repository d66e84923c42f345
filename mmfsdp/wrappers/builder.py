"""Find and check a ``model_wrapper_cfg`` before anything is built."""
import inspect
from typing import Any, Mapping, Optional

from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from torch import nn

from ..options import check_keys, suggest
from ..registry import MODEL_WRAPPERS

__all__ = ['check_wrapper_config', 'registered_wrapper_names', 'resolve_wrapper_type']


def registered_wrapper_names() -> list:
    """Every wrapper name a config can use: mmengine's and ``'mmfsdp.<Name>'``."""
    MODEL_WRAPPERS.import_from_location()
    return sorted(MMENGINE_MODEL_WRAPPERS.module_dict) + sorted(
        f'{MODEL_WRAPPERS.scope}.{n}' for n in MODEL_WRAPPERS.module_dict)


def resolve_wrapper_type(cfg: Mapping[str, Any]) -> type:
    """The class ``cfg['type']`` names, looked up as mmengine's ``Runner.wrap_model`` does."""
    name = cfg.get('type')
    cls = name if isinstance(name, type) else MMENGINE_MODEL_WRAPPERS.get(name)
    if cls is None:
        names = registered_wrapper_names()
        raise KeyError(f'model_wrapper_cfg.type: {name!r} is not a registered model wrapper'
                       f'{suggest(name, names)}; registered wrappers are {names}')
    return cls


def check_wrapper_config(cls: type, cfg: Mapping[str, Any],
                         module: Optional[nn.Module] = None) -> None:
    """Raise on keywords ``cls`` does not take and, for mmfsdp wrappers, on bad values.

    With ``module``, options checked against the model (wrap policies, layer
    classes) are checked too.
    """
    options = {k: v for k, v in cfg.items() if k != 'type'}
    check_config = getattr(cls, 'check_config', None)
    if check_config is not None:
        check_config(options, module)
        return
    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        check_keys(options, [n for n in params if n not in ('self', 'module')],
                   'model_wrapper_cfg')
