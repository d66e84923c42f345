"""Registries of mmfsdp: children of mmengine's, with the scope ``'mmfsdp'``.

A config names our classes ``'mmfsdp.<Name>'`` and mmengine's stock code paths
(``Runner.wrap_model``, ``RUNNERS.build`` ...) find them without ``custom_imports``.
The registries that hold nothing of ours exist so that a dict built in the
``mmfsdp`` scope finds mmengine's classes without a warning. ``FSDP_WRAP_POLICIES``
(no parent) holds the policies of ``auto_wrap_policy=dict(type=...)``.
"""
from mmengine import registry as mmengine_registry
from mmengine.registry import Registry

from .compat import register_config_package as register_package

__all__ = [
    'DATASETS', 'FSDP_WRAP_POLICIES', 'HOOKS', 'METRICS', 'MODELS',
    'MODEL_WRAPPERS', 'OPTIM_WRAPPERS', 'RUNNERS'
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
