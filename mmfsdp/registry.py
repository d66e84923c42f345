"""Registries of mmfsdp: children of mmengine's, with the scope ``'mmfsdp'``.

A config names our classes ``'mmfsdp.<Name>'`` and mmengine's stock code paths
(``Runner.wrap_model``, ``RUNNERS.build`` ...) find them without ``custom_imports``.
The registries that hold nothing of ours exist so that a dict built in the
``mmfsdp`` scope finds mmengine's classes without a warning. ``FSDP_WRAP_POLICIES``
(no parent) holds the policies of ``auto_wrap_policy=dict(type=...)``.

:func:`load_config` loads a config file the way mmfsdp's tools do:
``mmengine.config.Config.fromfile`` plus one thing. mmengine 0.10.7 resolves
``_base_ = ['mmfsdp::...']`` (the lookup :func:`register_config_package` serves)
with ``pkg_resources``, which it imports and reloads for every such base;
setuptools warns "pkg_resources is deprecated" on each, twice per process. The
lookup works, the warning is about mmengine's code, and the user cannot act on
it, so it is silenced for this call only, and only where mmengine's lookup raises it.
"""
import warnings

from mmengine import registry as mmengine_registry
from mmengine.config import Config
from mmengine.registry import Registry

from .compat import register_config_package as register_package

__all__ = [
    'DATASETS', 'FSDP_WRAP_POLICIES', 'HOOKS', 'METRICS', 'MODELS',
    'MODEL_WRAPPERS', 'OPTIM_WRAPPERS', 'RUNNERS', 'load_config', 'register_config_package'
]

SCOPE = 'mmfsdp'


def _child(name: str, location: str = 'mmfsdp') -> Registry:
    parent = getattr(mmengine_registry, name)
    return Registry(parent.name, parent=parent, scope=SCOPE, locations=[location])


#: Model wrappers: ``MMFullyShardedDataParallel`` (and its form for models with their own
#: steps, ``MMSeparateFullyShardedDataParallel``), ``MMFullyShard``, ``MMDistributedDataParallel``.
MODEL_WRAPPERS = _child('MODEL_WRAPPERS')
#: Runners: ``FSDPRunner``.
RUNNERS = _child('RUNNERS')
#: Optim wrappers: ``AmpOptimWrapper``.
OPTIM_WRAPPERS = _child('OPTIM_WRAPPERS')
#: Hooks: ``CheckpointHook``, ``EMAHook``.
HOOKS = _child('HOOKS')
# The demo workload fills these; it is imported on the first lookup, not by ``import mmfsdp``.
#: Models of the demo (``GPT``).
MODELS = _child('MODELS', 'mmfsdp.demo')
#: Datasets of the demo (``StdlibCharDataset``).
DATASETS = _child('DATASETS', 'mmfsdp.demo')
#: Metrics of the demo (``Perplexity``).
METRICS = _child('METRICS', 'mmfsdp.demo')

_CHILDREN = {
    name: _child(name)
    for name in ('RUNNER_CONSTRUCTORS', 'LOOPS', 'STRATEGIES', 'DATA_SAMPLERS', 'TRANSFORMS',
                 'WEIGHT_INITIALIZERS', 'OPTIMIZERS', 'OPTIM_WRAPPER_CONSTRUCTORS',
                 'PARAM_SCHEDULERS', 'EVALUATOR', 'TASK_UTILS', 'VISUALIZERS', 'VISBACKENDS',
                 'LOG_PROCESSORS', 'INFERENCERS', 'FUNCTIONS')
}

#: Wrap policies of ``auto_wrap_policy=dict(type=...)``: ``transformer``, ``module_types``,
#: ``size_based`` and your own (no mmengine parent).
FSDP_WRAP_POLICIES = Registry('fsdp wrap policy', scope=SCOPE, locations=['mmfsdp'])


def register_config_package() -> None:
    """Make mmengine's ``'mmfsdp::PATH'`` config lookup find ``mmfsdp/.mim/configs/PATH``."""
    # a module's name, not the distribution's: editable installs then find the real folder
    register_package(SCOPE, f'{SCOPE}.registry')


register_config_package()


#: Where mmengine's ``pkg::`` lookup imports (``package_utils``) and reloads
#: (``importlib``) ``pkg_resources``; a warning from anywhere else is shown.
_PKG_RESOURCES_IMPORTERS = r'(mmengine\.utils\.package_utils|importlib)$'


def load_config(path: str) -> Config:
    """``Config.fromfile(path)`` without mmengine's ``pkg_resources`` deprecation warnings."""
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='pkg_resources is deprecated as an API',
                                category=UserWarning, module=_PKG_RESOURCES_IMPORTERS)
        return Config.fromfile(path)
