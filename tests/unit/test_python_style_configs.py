"""Python-style configs (``with read_base(): from .base import *``, imported classes as values).

mmengine loads them lazily: an imported class or function is a ``LazyObject`` that its
``ConfigDict`` builds only when it hands the value out, so one inside a list or a set
(``layer_cls=[ToyBlock]``, ``transformer_layer_cls={ToyBlock}``) stays unbuilt.
:func:`~mmfsdp.wrappers.builder.model_wrapper_config` (which FSDPRunner and the plan CLI
read) builds them. The runs through a codebase's ``tools/train.py``:
``tests/zoo/test_mmpretrain.py::test_python_style_config_trains_through_mmpretrain_tools``.
"""
from mmengine.config import Config

from mmfsdp.wrappers.builder import model_wrapper_config, resolve_wrapper
from toy import ToyBlock, ToyClassifier

BASE = """\
from toy import ToyClassifier

model = dict(type=ToyClassifier, dim=16, depth=2)
"""
#: The wrapper named by its class, the layer classes imported (the Python-style form)...
CLASSES = """\
from mmengine.config import read_base
from torch.nn import LayerNorm

from mmfsdp import FSDPRunner, MMFullyShard
from toy import ToyBlock

with read_base():
    from .base import *

runner_type = FSDPRunner
model_wrapper_cfg = dict(
    type=MMFullyShard,
    auto_wrap_policy=dict(type='transformer', layer_cls=[ToyBlock]),
    activation_checkpointing=dict(layer_cls=(ToyBlock, )),
    mixed_precision=dict(param_dtype='bfloat16', fp32_modules=[LayerNorm]))
"""
#: ... and by name (the classic form).
NAMES = dict(
    type='mmfsdp.MMFullyShard',
    auto_wrap_policy=dict(type='transformer', layer_cls=['ToyBlock']),
    activation_checkpointing=dict(layer_cls=('ToyBlock', )),
    mixed_precision=dict(param_dtype='bfloat16', fp32_modules=['LayerNorm']))
#: mmdet's example_largemodel shape: a FlexibleRunner strategy with imported callables.
STRATEGY = """\
from mmengine.config import read_base
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from toy import ToyBlock

with read_base():
    from .base import *

runner_type = 'mmfsdp.FSDPRunner'
strategy = dict(
    type='FSDPStrategy',
    model_wrapper=dict(auto_wrap_policy=dict(type=transformer_auto_wrap_policy,
                                             transformer_layer_cls={ToyBlock})))
"""
STRATEGY_NAMES = dict(type='FSDPStrategy', model_wrapper=dict(auto_wrap_policy=dict(
    type='torch.distributed.fsdp.wrap.transformer_auto_wrap_policy',
    transformer_layer_cls={'ToyBlock'})))


def _load(tmp_path, text: str) -> Config:
    (tmp_path / 'base.py').write_text(BASE)
    (tmp_path / 'cfg.py').write_text(text)
    return Config.fromfile(str(tmp_path / 'cfg.py'))


def _resolved(cfg) -> tuple:
    wrapping = resolve_wrapper(model_wrapper_config(cfg))
    layout = wrapping.layout(ToyClassifier(dim=16, depth=2))
    return (wrapping.cls, layout.units, layout.checkpoint_layers, layout.fp32_modules,
            wrapping.config.mixed_precision)


def test_wrapper_named_by_class_with_imported_layer_classes(tmp_path):
    cfg = _load(tmp_path, CLASSES)
    assert cfg.runner_type.__name__ == 'FSDPRunner'  # mmengine's RUNNERS.build takes a class
    got = _resolved(cfg)
    assert got == _resolved(dict(model_wrapper_cfg=NAMES))
    assert got[1] == ('blocks.0', 'blocks.1') and got[2] == (ToyBlock, )
    assert got[3] == ('blocks.0.norm', 'blocks.1.norm', 'norm')


def test_strategy_with_imported_callables(tmp_path):
    cfg = _load(tmp_path, STRATEGY)
    wrapper_cfg = model_wrapper_config(cfg)
    assert wrapper_cfg['auto_wrap_policy'] == dict(type='transformer', layer_cls={ToyBlock})
    assert _resolved(cfg) == _resolved(dict(strategy=STRATEGY_NAMES))
    assert _resolved(cfg)[1] == ('blocks.0', 'blocks.1')
