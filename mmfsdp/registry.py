"""Registries of mmfsdp.

Every registry here is a child of mmengine's registry of the same kind with the
scope ``'mmfsdp'``, so a config names our classes as ``'mmfsdp.<Name>'`` and
mmengine's stock code paths (``Runner.wrap_model``, ``RUNNERS.build``,
``build_optim_wrapper`` ...) find them without ``custom_imports``: the scope
prefix makes mmengine import this module, and ``locations`` make each registry
import the modules that fill it.

The other registries (loops, samplers, schedulers, functions, ...) hold
nothing of ours; they exist so that a dict built in the ``mmfsdp`` scope finds
its class in mmengine's registry without a warning, as in every OpenMMLab
package. A config that inherits ours through ``mmfsdp::`` has ``_scope_='mmfsdp'``
in every inherited dict with a ``type``.

``FSDP_WRAP_POLICIES`` has no mmengine parent: it holds the auto-wrap policies
that the FSDP wrappers resolve ``auto_wrap_policy=dict(type=...)`` against.

Importing this module also lets configs of other projects inherit ours with
``_base_ = ['mmfsdp::_base_/models/gpt_nano.py']`` (see
:func:`register_config_package`).
"""
from mmengine import registry as mmengine_registry
from mmengine.registry import DATASETS as MMENGINE_DATASETS
from mmengine.registry import HOOKS as MMENGINE_HOOKS
from mmengine.registry import METRICS as MMENGINE_METRICS
from mmengine.registry import MODEL_WRAPPERS as MMENGINE_MODEL_WRAPPERS
from mmengine.registry import MODELS as MMENGINE_MODELS
from mmengine.registry import OPTIM_WRAPPERS as MMENGINE_OPTIM_WRAPPERS
from mmengine.registry import RUNNERS as MMENGINE_RUNNERS
from mmengine.registry import Registry

from .compat import register_config_package as register_package

__all__ = [
    'DATASETS', 'FSDP_WRAP_POLICIES', 'HOOKS', 'METRICS', 'MODELS',
    'MODEL_WRAPPERS', 'OPTIM_WRAPPERS', 'RUNNERS'
]

SCOPE = 'mmfsdp'

MODEL_WRAPPERS = Registry(
    'model_wrapper',
    parent=MMENGINE_MODEL_WRAPPERS,
    scope=SCOPE,
    locations=['mmfsdp'])
RUNNERS = Registry(
    'runner', parent=MMENGINE_RUNNERS, scope=SCOPE,
    locations=['mmfsdp'])
OPTIM_WRAPPERS = Registry(
    'optim_wrapper', parent=MMENGINE_OPTIM_WRAPPERS, scope=SCOPE, locations=['mmfsdp'])
HOOKS = Registry(
    'hook', parent=MMENGINE_HOOKS, scope=SCOPE, locations=['mmfsdp'])
# The demo workload fills these; it is imported on the first lookup, not by ``import mmfsdp``.
MODELS = Registry('model', parent=MMENGINE_MODELS, scope=SCOPE, locations=['mmfsdp.demo'])
DATASETS = Registry('dataset', parent=MMENGINE_DATASETS, scope=SCOPE, locations=['mmfsdp.demo'])
METRICS = Registry('metric', parent=MMENGINE_METRICS, scope=SCOPE, locations=['mmfsdp.demo'])

#: mmengine's other root registries, by name: children with nothing of ours in them.
_EMPTY_CHILDREN = ('RUNNER_CONSTRUCTORS', 'LOOPS', 'STRATEGIES', 'DATA_SAMPLERS', 'TRANSFORMS',
                   'WEIGHT_INITIALIZERS', 'OPTIMIZERS', 'OPTIM_WRAPPER_CONSTRUCTORS',
                   'PARAM_SCHEDULERS', 'EVALUATOR', 'TASK_UTILS', 'VISUALIZERS', 'VISBACKENDS',
                   'LOG_PROCESSORS', 'INFERENCERS', 'FUNCTIONS')
_CHILDREN = {
    name: Registry(getattr(mmengine_registry, name).name, parent=getattr(mmengine_registry, name),
                   scope=SCOPE, locations=['mmfsdp'])
    for name in _EMPTY_CHILDREN
}

FSDP_WRAP_POLICIES = Registry(
    'fsdp wrap policy', scope=SCOPE, locations=['mmfsdp'])


def register_config_package() -> None:
    """Make mmengine's ``'mmfsdp::PATH'`` config lookup find ``mmfsdp/.mim/configs/PATH``.

    mmengine 0.10.7 accepts ``'pkg::'`` only for the modules in its
    ``MODULE2PACKAGE`` table (an ``AssertionError`` otherwise), so ``mmfsdp``
    adds itself there. The value is the name mmengine passes to
    ``pkg_resources.get_distribution`` and, when that finds nothing, to
    ``importlib.util.find_spec``, whose origin's folder it takes as the
    package folder. It is deliberately the *module* ``mmfsdp.registry``, no
    distribution's name: ``get_distribution('mmfsdp')`` would answer with the
    ``site-packages`` folder even for an editable install (``pip install -e
    .``), where ``mmfsdp/`` is the working tree and ``site-packages/mmfsdp``
    does not exist; the import system knows where the package really is, for
    regular and editable installs and for ``PYTHONPATH`` alike.
    """
    register_package(SCOPE, f'{SCOPE}.registry')


register_config_package()
