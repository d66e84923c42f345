"""FSDPRunner runs mmdet's ``SyncNormHook`` as ``mmfsdp.SyncNormHook``, matched by name.

mmdet is not installed here: the config names the hook as YOLOX's configs do
(``'SyncNormHook'``, found in mmdet's scope) or with the scope (``'mmdet.SyncNormHook'``,
which would import mmdet). mmengine's hook classes (a Python-style config's ``type``) are
matched by their names too, a class of another package is not. ``tests/dist/test_sync_norm.py``
runs the hook; ``tests/zoo/test_mmdet_hooks.py`` runs it for mmdet's own (name and class).
"""
import mmengine.hooks
import pytest
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from mmfsdp import FSDPRunner, ema
from mmfsdp.checkpoint import CheckpointHook
from mmfsdp.sync_norm import SyncNormHook


@HOOKS.register_module(name='UnitEMAHook')
class EMAHook(Hook):
    """A hook of another package, named as mmengine's."""


def _registered(cfg: dict) -> Hook:
    runner = FSDPRunner.__new__(FSDPRunner)  # register_hook needs only the hook list
    runner._hooks = []
    runner.register_hook(cfg)
    (hook,) = runner.hooks
    return hook


@pytest.mark.parametrize('name', ['SyncNormHook', 'mmdet.SyncNormHook'])
def test_mmdets_sync_norm_hook_becomes_mmfsdps_with_its_priority(name):
    cfg = dict(type=name, priority=48)  # as in YOLOX's configs
    hook = _registered(cfg)
    assert type(hook) is SyncNormHook and hook.priority == 48
    assert cfg == dict(type=name, priority=48)  # the user's config is left as it was


@pytest.mark.parametrize('cls, replacement', [(mmengine.hooks.EMAHook, ema.EMAHook),
                                              (mmengine.hooks.CheckpointHook, CheckpointHook),
                                              (EMAHook, EMAHook)])
def test_hook_classes_are_replaced_by_name_only_for_mmengine_and_mmdet(cls, replacement):
    assert type(_registered(dict(type=cls))) is replacement
