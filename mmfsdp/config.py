"""Load a config file the way mmfsdp's tools do.

``mmengine.config.Config.fromfile`` plus one thing: mmengine 0.10.7 resolves
``_base_ = ['mmfsdp::...']`` with ``pkg_resources``, which it imports and
reloads for every such base; setuptools warns "pkg_resources is deprecated"
on each, twice per process. The lookup works, the warning is about mmengine's
code, and the user cannot act on it, so it is silenced for this call only,
and only where mmengine's lookup raises it.
"""
import warnings

from mmengine.config import Config

__all__ = ['load_config']

#: Where mmengine's ``pkg::`` lookup imports (``package_utils``) and reloads
#: (``importlib``) ``pkg_resources``; a warning from anywhere else is shown.
_PKG_RESOURCES_IMPORTERS = r'(mmengine\.utils\.package_utils|importlib)$'


def load_config(path: str) -> Config:
    """``Config.fromfile(path)`` without mmengine's ``pkg_resources`` deprecation warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='pkg_resources is deprecated as an API',
                                category=UserWarning, module=_PKG_RESOURCES_IMPORTERS)
        return Config.fromfile(path)
