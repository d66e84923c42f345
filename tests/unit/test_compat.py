"""One test per private mmengine / torch internal that :mod:`mmfsdp.compat` relies on.

Each fails with a message naming the internal when a new mmengine or torch
release renames it, changes its signature or stops doing what mmfsdp relies
on; the fix is in ``mmfsdp/compat/`` (and wherever that message points).
Single process, no process group: these read the installed libraries.
"""
import hashlib
import inspect
import re
import textwrap
from collections import deque

import pytest
import torch
import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp1_module
from mmengine.config import Config
from mmengine.hooks import CheckpointHook
from mmengine.model import BaseModel, BaseModule
from mmengine.model.weight_init import PretrainedInit
from mmengine.optim import AmpOptimWrapper, OptimWrapper
from mmengine.registry import MODEL_WRAPPERS
from mmengine.runner import Runner
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.fsdp import _init_utils as fsdp_init_utils
from torch.distributed.fsdp._flat_param import FlatParamHandle

from mmfsdp import compat


def _parameters(function) -> list:
    return list(inspect.signature(function).parameters)


def _source(function) -> str:
    return textwrap.dedent(inspect.getsource(function))


def _calls_in_order(function, calls) -> None:
    source = _source(function)
    where = [source.find(call) for call in calls]
    assert -1 not in where and where == sorted(where), (
        f'{function.__qualname__} no longer runs {calls} in this order; mmfsdp relies on it '
        '(see mmfsdp/compat/mmengine_private.py)')


class _Model(BaseModel):

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, inputs=None, data_samples=None, mode='tensor'):
        return self.fc(inputs)


class _Pretrained(BaseModule):

    def __init__(self, init_cfg=None) -> None:
        super().__init__(init_cfg=init_cfg)
        self.fc = nn.Linear(2, 2)


@pytest.fixture(scope='module')
def runner(tmp_path_factory):
    """A stock Runner, one process, asked to load and resume (nothing is read)."""
    return Runner(model=_Model(), work_dir=str(tmp_path_factory.mktemp('compat')),
                  load_from='missing.pth', resume=True, experiment_name='compat_test')


# ---- mmengine --------------------------------------------------------------


def test_runner_train_initialises_weights_privately_before_load_or_resume():
    assert _parameters(Runner._init_model_weights) == ['self'], \
        'Runner._init_model_weights changed its signature (mmfsdp.compat.RunnerSteps overrides it)'
    _calls_in_order(Runner.train, ['self.build_optim_wrapper(', "self.call_hook('before_run')",
                                   'self._init_model_weights()', 'self.load_or_resume()'])


def test_runner_steps_route_the_private_step_to_its_public_name():
    calls = []

    class Recording(compat.RunnerSteps):

        def init_model_weights(self) -> None:
            calls.append('init_model_weights')

    Recording._init_model_weights(object.__new__(Recording))
    assert calls == ['init_model_weights']


def test_runner_keeps_load_from_and_resume_privately(runner):
    assert compat.load_from(runner) == 'missing.pth', 'Runner no longer keeps _load_from'
    assert compat.resume_requested(runner) is True, 'Runner no longer keeps _resume'


def test_load_or_resume_skips_a_loaded_checkpoint_by_has_loaded(runner):
    assert runner._has_loaded is False, 'Runner.__init__ no longer sets _has_loaded'
    compat.mark_checkpoint_loaded(runner)
    runner.load_or_resume()  # would try to read missing.pth without the flag


def test_checkpoint_hook_saves_through_its_private_steps():
    hook = CheckpointHook
    expected = {'_save_checkpoint_with_step': ['self', 'runner', 'step', 'meta'],
                '_save_best_checkpoint': ['self', 'runner', 'metrics'],
                '_publish_model': ['self', 'runner', 'ckpt_path'],
                '_init_rule': ['self', 'rules', 'key_indicators']}
    for name, parameters in expected.items():
        assert _parameters(getattr(hook, name, None) or (lambda: None)) == parameters, (
            f'CheckpointHook.{name} changed; mmfsdp.compat.CheckpointHookSteps overrides it')
    _calls_in_order(hook._save_checkpoint, ['self._save_checkpoint_with_step('])
    _calls_in_order(hook._save_best_checkpoint, ['self._save_checkpoint_with_step('])
    _calls_in_order(hook.after_val_epoch, ['self._save_best_checkpoint('])
    _calls_in_order(hook.after_train, ['self._publish_model('])


#: sha256 of the stock methods mmfsdp.checkpoint.hook re-implements (mmengine 0.10.7).
_REIMPLEMENTED = {
    '_save_checkpoint_with_step':
        '9b971b6cd3cc507da3041d5432ba5766d048eeebcf8b365df4417729c92d4763',
    '_save_best_checkpoint':
        'b66a8a9e45854dcb8985bba7ad9de337c21b353aff56a3af8445f21bc9269744',
}


@pytest.mark.parametrize('name', sorted(_REIMPLEMENTED))
def test_checkpoint_hook_methods_mmfsdp_reimplements_are_unchanged(name):
    digest = hashlib.sha256(_source(getattr(CheckpointHook, name)).encode()).hexdigest()
    assert digest == _REIMPLEMENTED[name], (
        f"mmengine's CheckpointHook.{name} changed (sha256 {digest}); "
        'mmfsdp/checkpoint/hook.py re-implements it: carry the change over, then record the '
        'new digest here')


def test_checkpoint_hook_state_read_through_compat(runner):
    hook = compat.CheckpointHookSteps(interval=1, by_epoch=False, max_keep_ckpts=2, save_best='acc',
                                      state_dict_type='sharded')
    hook.before_train(runner)
    assert isinstance(hook.kept_steps, deque), 'CheckpointHook.keep_ckpt_ids is gone'
    assert hook.name_template == 'iter_{}.pth', 'CheckpointHook.filename_tmpl changed'
    assert hook.checkpoint_path(hook.checkpoint_name(3)).endswith('iter_3.pth'), \
        'CheckpointHook.file_backend.join_path changed'
    assert hook.save_kwargs == {'state_dict_type': 'sharded'}, \
        'CheckpointHook.args no longer holds the extra config keys'
    for name in ('rules', 'key_indicators', 'init_value_map', 'is_better_than',
                 'best_ckpt_path', 'last_ckpt', 'out_dir', 'file_client_args', 'backend_args'):
        assert hasattr(hook, name), f'CheckpointHook.{name} is gone (mmfsdp save_best reads it)'


def test_ema_hook_decides_when_to_average_and_swaps_its_checkpoint_entries_privately():
    from types import SimpleNamespace

    from mmengine.hooks import EMAHook
    by_iter, by_epoch = EMAHook(begin_iter=2), EMAHook(begin_epoch=2)
    started = [compat.ema_started(hook, SimpleNamespace(iter=step, epoch=step))
               for hook in (by_iter, by_epoch) for step in (0, 1)]
    assert started == [False, True, False, True], \
        'EMAHook._ema_started no longer starts at begin_iter / begin_epoch - 1 (mmfsdp.ema)'
    checkpoint = dict(state_dict=dict(w='trained', b='buffer'),
                      ema_state_dict={'module.w': 'averaged', 'steps': 3})
    compat.swap_ema_state_dict(by_iter, checkpoint)
    assert checkpoint == dict(state_dict=dict(w='averaged', b='buffer'),
                              ema_state_dict={'module.w': 'trained', 'steps': 3}), \
        "EMAHook._swap_ema_state_dict no longer swaps the 'module.'-prefixed entries (mmfsdp.ema)"


def test_ema_hook_swaps_parameters_only_in_methods_mmfsdp_overrides():
    """mmfsdp's hook swaps its pieces in its own ``_swap_averaged``; no stock swap may run."""
    from mmengine.hooks import EMAHook

    from mmfsdp.ema import EMAHook as OurEMAHook
    swapping = {name for name, member in vars(EMAHook).items()
                if callable(member) and name != '_swap_ema_parameters'
                and 'self._swap_ema_parameters()' in _source(member)}
    assert swapping == {'before_val_epoch', 'after_val_epoch', 'before_test_epoch',
                        'after_test_epoch'}, \
        f"mmengine's EMAHook now swaps the whole model's parameters in {sorted(swapping)}"
    assert swapping <= set(vars(OurEMAHook)), 'mmfsdp.ema.EMAHook must override them all'


def test_optim_wrapper_keeps_clip_grad_as_clip_func_and_kwargs():
    params = [nn.Parameter(torch.ones(2))]
    by_norm = OptimWrapper(torch.optim.SGD(params, lr=0.1),
                           clip_grad=dict(max_norm=1.0, norm_type=2))
    by_value = OptimWrapper(torch.optim.SGD(params, lr=0.1),
                            clip_grad=dict(type='value', clip_value=0.5))
    assert compat.norm_clip_options(by_norm) == dict(max_norm=1.0, norm_type=2), \
        'OptimWrapper.clip_func / clip_grad_kwargs changed'
    assert compat.norm_clip_options(by_value) is None
    assert compat.norm_clip_options(OptimWrapper(torch.optim.SGD(params, lr=0.1))) is None


def test_optim_wrapper_step_clips_through_private_clip_grad():
    param = nn.Parameter(torch.ones(2))
    wrapper = OptimWrapper(torch.optim.SGD([param], lr=0.1), clip_grad=dict(max_norm=1.0))
    stock_calls, calls = [], []
    wrapper.clip_func = lambda *a, **k: stock_calls.append(a)
    wrapper._clip_grad()  # no gradient on this rank: the stock method skips the clip
    assert stock_calls == [], 'OptimWrapper._clip_grad no longer skips a rank without gradients'
    compat.replace_grad_clipping(wrapper, lambda: calls.append('clip'))
    wrapper.update_params((param * 2).sum())
    assert calls == ['clip'], 'OptimWrapper.step no longer clips through _clip_grad'


def test_amp_optim_wrapper_init_sets_only_what_mmfsdp_sets():
    source = _source(AmpOptimWrapper.__init__)
    assigned = set(re.findall(r'self\.(\w+)\s*=', source))
    assert assigned == {'_scale_update_param', 'loss_scaler', 'cast_dtype'}, (
        f"mmengine's AmpOptimWrapper.__init__ now sets {sorted(assigned)}; mmfsdp.amp skips "
        'it (it asserts CUDA) and must set the same state')
    assert 'super().__init__(**kwargs)' in source
    assert 'self.loss_scaler.update(self._scale_update_param)' in _source(AmpOptimWrapper.step), \
        'AmpOptimWrapper.step no longer reads _scale_update_param'


def test_pkg_prefix_resolves_through_module2package(tmp_path):
    from mmengine.config.utils import MODULE2PACKAGE
    assert MODULE2PACKAGE.get('mmfsdp') == 'mmfsdp.registry'
    config = tmp_path / 'child.py'
    config.write_text("_base_ = ['mmfsdp::_base_/models/gpt_nano.py']\n")
    assert 'model' in Config.fromfile(str(config)), "mmengine's 'pkg::' lookup changed"


def test_pretrained_init_runs_through_its_call_inside_init_weights(tmp_path):
    torch.save(nn.Linear(2, 2).state_dict(), tmp_path / 'w.pth')
    module = _Pretrained(init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'w.pth')))
    seen = []

    def call(init, target):
        seen.append((type(init).__name__, hasattr(target, '_params_init_info')))
        compat.record_init_info(init, target)

    with compat.pretrained_init_calls(call):
        module.init_weights()
    assert seen == [('PretrainedInit', True)], (
        "BaseModule.init_weights no longer calls PretrainedInit.__call__ while it keeps "
        '_params_init_info (mmfsdp.meta_init.materialize replaces the call)')
    assert PretrainedInit.__call__ is not call


def test_mmengine_loaders_read_through_checkpoint_loader_load_checkpoint():
    weights = {f'fc.{k}': v for k, v in nn.Linear(2, 2).state_dict().items()}
    seen = []

    def read(filename, map_location=None, logger=None):
        seen.append(filename)
        return dict(state_dict=dict(weights, **{f'backbone.{k}': v for k, v in weights.items()}))

    from mmengine.runner import CheckpointLoader, load_checkpoint
    original = CheckpointLoader.__dict__['load_checkpoint']
    url = 'http://nothing.invalid/w.pth'  # never fetched
    loaded = {}
    with compat.checkpoint_loader_replaced_by(read):
        for how, init_cfg in (('Pretrained', dict(type='Pretrained', checkpoint=url)),
                              ('Pretrained with a prefix', dict(type='Pretrained', checkpoint=url,
                                                                prefix='backbone'))):
            module = _Pretrained(init_cfg=init_cfg)
            module.init_weights()
            loaded[how] = module.state_dict()
        module = _Pretrained()
        load_checkpoint(module, url, map_location='cpu')  # a Swin backbone's own call
        loaded['load_checkpoint'] = module.state_dict()
    assert seen == [url] * 3 and all(
        torch.equal(state[k], weights[k]) for state in loaded.values() for k in weights), (
        "mmengine's PretrainedInit or load_checkpoint no longer reads through "
        'CheckpointLoader.load_checkpoint (mmfsdp.checkpoint.safe_io.safe_reads replaces it)')
    assert CheckpointLoader.__dict__['load_checkpoint'] is original


def test_stock_wrap_model_builds_the_wrapper_from_keyword_options():
    seen = []

    @MODEL_WRAPPERS.register_module(name='CompatTestProbeWrapper', force=True)
    class Probe(nn.Module):

        def __init__(self, **kwargs) -> None:
            super().__init__()
            seen.append(sorted(kwargs))

    class Stub:
        distributed = True
        cfg: dict = {}

    Runner.wrap_model(Stub(), dict(type='CompatTestProbeWrapper', option=1), nn.Linear(2, 2))
    assert seen == [['module', 'option']], \
        ('Runner.wrap_model no longer passes the config\'s options as keywords: '
         'mmfsdp.wrappers.base.refuse_keyword_build tells the stock Runner apart by them')


def test_batch_norm_base_is_the_base_of_every_batch_norm():
    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
        assert issubclass(cls, compat.BATCH_NORM_BASE), \
            f'{cls.__name__} is no longer a torch.nn.modules.batchnorm._BatchNorm'


def test_norm_base_is_the_base_of_every_norm_with_running_statistics():
    for cls in (nn.BatchNorm2d, nn.SyncBatchNorm, nn.InstanceNorm2d, nn.LazyBatchNorm2d):
        assert issubclass(cls, compat.NORM_BASE), \
            f'{cls.__name__} is no longer a torch.nn.modules.batchnorm._NormBase'
    assert not issubclass(nn.GroupNorm, compat.NORM_BASE)


def test_fsdp1_mixed_precision_names_its_fp32_classes_privately():
    from torch.distributed.fsdp import MixedPrecision
    default = MixedPrecision(param_dtype=torch.bfloat16)
    assert compat.fsdp1_fp32_classes(default) == (compat.BATCH_NORM_BASE, ), \
        "FSDP1's MixedPrecision._module_classes_to_ignore no longer defaults to _BatchNorm"
    kept = compat.with_fsdp1_fp32_classes(default, (nn.GroupNorm, ))
    assert compat.fsdp1_fp32_classes(kept) == (nn.GroupNorm, )
    assert kept.param_dtype is torch.bfloat16


# ---- torch -----------------------------------------------------------------


def test_activation_checkpoint_wrapper_holds_the_module_as_checkpoint_wrapped_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    compat.apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: compat.checkpoint_wrapper(
            m, checkpoint_impl=compat.CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, nn.Linear))
    assert isinstance(model[0], compat.ActivationWrapper)
    assert isinstance(compat.checkpoint_inner(model[0]), nn.Linear), \
        f'the checkpoint wrapper no longer holds its module as {compat.CHECKPOINT_WRAPPED_MODULE}'
    assert compat.checkpoint_inner(model[1]) is None


def test_module_compile_is_seen_by_compiled_modules():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    model[1].compile(backend='eager')
    assert compat.compiled_modules(model) == ('1', ), \
        'nn.Module.compile no longer keeps _compiled_call_impl: UsageProbe hooks compiled layers'


def test_activation_memory_budget_is_the_partitioners_setting():
    import torch._functorch.config as functorch_config
    before = functorch_config.activation_memory_budget
    try:
        compat.set_activation_memory_budget(0.25)
        assert functorch_config.activation_memory_budget == 0.25
    finally:
        functorch_config.activation_memory_budget = before


def test_fsdp1_names_its_wrapped_module():
    assert fsdp1_module.FSDP_WRAPPED_MODULE == compat.FSDP_WRAPPED_MODULE


def test_hybrid_shard_zero2_exists():
    assert ShardingStrategy['_HYBRID_SHARD_ZERO2'] is compat.HYBRID_SHARD_ZERO2


def test_fsdp1_reshard_and_the_handle_state_it_reads():
    from mmfsdp.compat import torch_private
    assert _parameters(torch_private._reshard) == ['state', 'handle',
                                                   'free_unsharded_flat_param'], \
        'torch.distributed.fsdp._runtime_utils._reshard changed (mmfsdp.ema reshards with it)'
    assert 'state._handle = ' in inspect.getsource(fsdp_init_utils), \
        'FSDP1 no longer keeps its FlatParamHandle as _handle'
    for name in ('uses_sharded_strategy', 'is_sharded', 'needs_unshard'):
        assert hasattr(FlatParamHandle, name), f'FlatParamHandle.{name} is gone'
    assert 'flat_param._full_param_padded = ' in _source(
        FlatParamHandle.init_flat_param_attributes), \
        "FSDP1's gathered buffer is no longer FlatParameter._full_param_padded"


def test_attention_initialises_in_private_reset_parameters():
    attention = nn.MultiheadAttention(4, 2)
    assert not hasattr(attention, 'reset_parameters')
    assert compat.initialiser(attention) == attention._reset_parameters, \
        'nn.MultiheadAttention no longer initialises in _reset_parameters'
    linear = nn.Linear(2, 2)
    assert compat.initialiser(linear) == linear.reset_parameters


def test_dispatch_mode_sees_operators_with_their_written_arguments():
    seen = []

    class Watch(compat.TorchDispatchMode):

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((compat.operator_name(func), compat.argument_names(func),
                         compat.written_arguments(func)))
            return func(*args, **(kwargs or {}))

    x = torch.zeros(2)
    with Watch():
        x.add_(1)
    assert ('aten::add_', ['self', 'other', 'alpha'], ['self']) in seen


def test_storage_key_tells_meta_storages_apart():
    a, b = torch.empty(4, device='meta'), torch.empty(4, device='meta')
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # why it exists
    assert compat.storage_key(a) == compat.storage_key(a[1:])
    assert compat.storage_key(a) != compat.storage_key(b)


def test_dcp_names_state_through_fqn_modifiers():

    @compat.dcp_drops_names
    class Holder(nn.Module):

        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Sequential(nn.Linear(2, 2))

        def state_dict(self, *args, **kwargs):
            return self.module.state_dict(*args, **kwargs)

        def named_parameters(self, *args, **kwargs):
            return self.module.named_parameters(*args, **kwargs)

        def dropped_name_components(self):
            return {name: 'module' for name, _ in self.module.named_children()}

    assert sorted(get_model_state_dict(Holder())) == ['0.bias', '0.weight'], \
        "DCP's get_model_state_dict no longer honours _fqn_modifiers"


def test_convert_tensors_applies_a_function_to_every_parameter_and_buffer():
    model = nn.BatchNorm1d(2, device='meta')
    model.running_mean = torch.full((2, ), 3.0)
    compat.convert_tensors(
        model, lambda t: torch.empty_like(t, device='cpu') if t.is_meta else t)
    assert isinstance(model.weight, nn.Parameter) and model.weight.requires_grad, \
        'nn.Module._apply no longer keeps parameters as trainable Parameters'
    assert all(not t.is_meta for t in [*model.parameters(), *model.buffers()]), \
        'nn.Module._apply no longer reaches every parameter and buffer'
    assert model.running_mean.tolist() == [3.0, 3.0]


def test_registered_children_are_the_tree_whatever_named_children_says():

    class Renaming(nn.Module):

        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.register_module('empty', None)

        def named_children(self):
            return iter(())

        def get_submodule(self, target):
            raise AttributeError(target)

    wrapper = Renaming()
    assert compat.registered_children(wrapper) == [('module', wrapper.module), ('empty', None)], \
        'nn.Module no longer keeps its children in _modules'
    assert compat.registered_child(wrapper, 'module') is wrapper.module


def test_registration_dicts_hold_none_slots_and_swap_without_registering():
    module = nn.Module()
    module.register_parameter('p', None)
    module.register_parameter('w', nn.Parameter(torch.ones(1)))
    module.register_buffer('b', torch.zeros(1), persistent=False)
    assert [n for n, _ in compat.direct_tensors(module)] == ['p', 'w', 'b']
    compat.replace_registered(module, 'b', torch.ones(1))
    compat.replace_registered(module, 'w', nn.Parameter(torch.zeros(1)))
    assert compat.direct_tensor(module, 'b').item() == 1.0 and module.w.item() == 0.0
    assert list(module.state_dict()) == ['w'], 'a swapped buffer must stay non-persistent'


def test_fake_tensor_mode_computes_shapes_without_storage():
    from mmfsdp.compat import fake_tensor_mode
    with fake_tensor_mode():
        x = torch.ones(4, 8)  # a real CPU input is converted on first use
        y = torch.nn.functional.linear(torch.empty(1024, 1024), torch.empty(16, 1024))
        z = (x @ torch.empty(8, 3)).sum()
    assert y.shape == (1024, 16) and y.device.type == 'cpu' and z.shape == ()
    assert type(y).__name__ == 'FakeTensor'


def test_fake_tensors_are_told_apart_and_real_ones_made_inside_fake_mode():
    with compat.fake_tensor_mode():
        fake = torch.empty(3)
        with compat.dispatch_modes_off():
            real = torch.ones(3)
            assert not compat.is_fake(real) and real.sum().item() == 3.0
        assert compat.is_fake(fake) and compat.is_fake(fake + 1)
    assert not compat.is_fake(real)


def test_fsdp1_no_sync_toggles_the_flag_its_backward_reads():
    from torch.distributed.fsdp import _runtime_utils
    assert 'm._sync_gradients = False' in _source(FullyShardedDataParallel.no_sync), \
        'FSDP1.no_sync no longer sets _sync_gradients (compat.set_fsdp1_gradient_sync)'
    assert '_sync_gradients' in inspect.getsource(_runtime_utils), \
        "FSDP1's backward no longer reads _sync_gradients (compat.set_fsdp1_gradient_sync)"


def _dcp_checkpoint(path) -> str:
    """A DCP checkpoint torch writes: tensors of several dtypes and layouts, pickled entries."""
    import warnings

    import torch.distributed.checkpoint as dcp
    state = dict(model={'w': torch.ones(2, 3).t(), 'half': torch.zeros(2, dtype=torch.bfloat16),
                        'mask': torch.ones(2, dtype=torch.bool), 'step': torch.tensor(3)},
                 extra={'count': 3, 'names': ['a', 'b']})
    with warnings.catch_warnings():  # DCP: "assuming the intent is to save in a single process"
        warnings.simplefilter('ignore')
        dcp.save(state, checkpoint_id=str(path))
    return str(path)


def test_dcp_reader_reads_metadata_from_the_file_its_writer_writes(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    reader = FileSystemReader(_dcp_checkpoint(tmp_path / 'ckpt'))
    path = compat.dcp_metadata_path(reader)
    assert str(path) == str(tmp_path / 'ckpt' / '.metadata') and path.exists(), \
        "DCP's FileSystemReader._get_metadata_path moved (compat.dcp_metadata_path)"
    assert str(compat.dcp_metadata_path(reader, 1)) == str(tmp_path / 'ckpt' / '__1.metadata')


def test_safe_dcp_reader_returns_what_torchs_reader_returns(tmp_path):
    """``SafeFileSystemReader.read_metadata`` re-implements torch's (with another unpickler)."""
    from torch.distributed.checkpoint import FileSystemReader

    from mmfsdp.checkpoint.safe_io import SafeFileSystemReader
    reader = SafeFileSystemReader(_dcp_checkpoint(tmp_path / 'ckpt'))
    assert reader.read_metadata() == FileSystemReader.read_metadata(reader), \
        "FileSystemReader.read_metadata changed what it returns (mmfsdp/checkpoint/safe_io.py)"


def test_dcp_metadata_names_only_globals_the_safe_reader_allows(tmp_path):
    import pickle

    from mmfsdp.checkpoint.safe_io import METADATA_GLOBALS
    named = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            named.add((module, name))
            return super().find_class(module, name)

    path = _dcp_checkpoint(tmp_path / 'ckpt')
    with open(f'{path}/.metadata', 'rb') as f:
        Recorder(f).load()
    assert named <= set(METADATA_GLOBALS), (
        f'DCP metadata now names {sorted(named - set(METADATA_GLOBALS))}: add them to the '
        'allow-list in mmfsdp/checkpoint/safe_io.py (and compat.dcp_metadata_private_globals)')
    private = {(g.__module__, g.__qualname__) for g in compat.dcp_metadata_private_globals()}
    assert private <= named, f'DCP metadata no longer names {sorted(private - named)}'


def test_dcp_tensor_properties_pickle_five_fields_then_the_newer_strides():
    """``TensorProperties.__getstate__``: (dtype, layout, requires_grad, memory format,
    pin_memory), torch 2.15 appending ``strides``; ``compat.dcp_tensor_properties`` reads
    both forms on this torch (a 2.15 checkpoint under 2.13 / 2.14, and back)."""
    from torch.distributed.checkpoint.metadata import TensorProperties
    written = TensorProperties.create_from_tensor(torch.ones(2, 3).t()).__getstate__()
    assert isinstance(written, tuple) and written[:3] == (torch.float32, torch.strided, False) \
        and written[4] is False and len(written) in (5, 6), \
        f'TensorProperties now pickles {written!r} (compat.dcp_tensor_properties)'
    read = compat.dcp_tensor_properties()
    for state in (written[:5], written[:5] + ((1, 3), )):
        properties = read.__new__(read)
        properties.__setstate__(state)
        assert type(properties) is TensorProperties and (
            properties.dtype, properties.memory_format) == (torch.float32,
                                                            torch.contiguous_format)


def test_the_safe_reader_reads_the_metadata_of_a_newer_torch(tmp_path, monkeypatch):
    """A ``.metadata`` whose ``TensorProperties`` carry ``strides`` (torch 2.15 writes them)
    is read on this torch too; before, under 2.13: 'too many values to unpack (expected 5)'."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    from mmfsdp.checkpoint.safe_io import SafeFileSystemReader
    if len(TensorProperties().__getstate__()) == 5:  # write as torch 2.15 does
        five = TensorProperties.__getstate__
        monkeypatch.setattr(TensorProperties, '__getstate__', lambda self: (*five(self), None))
    path = _dcp_checkpoint(tmp_path / 'ckpt')
    monkeypatch.undo()
    metadata = SafeFileSystemReader(path).read_metadata()
    assert metadata.state_dict_metadata['model.half'].properties.dtype == torch.bfloat16
    got = compat.load_whole_dcp(SafeFileSystemReader(path))
    assert torch.equal(got['model']['w'], torch.ones(2, 3).t()) and got['extra']['count'] == 3


def test_load_whole_dcp_reads_what_dcp_to_torch_save_writes(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = _dcp_checkpoint(tmp_path / 'ckpt')
    dcp_to_torch_save(path, tmp_path / 'full.pth')
    expected = torch.load(tmp_path / 'full.pth')
    got = compat.load_whole_dcp(FileSystemReader(path))
    assert got.keys() == expected.keys() and got['extra'] == expected['extra']
    assert all(torch.equal(got['model'][k], v) for k, v in expected['model'].items()), \
        'compat.load_whole_dcp no longer reads what dcp_to_torch_save writes'


def test_torch_compile_reports_a_reached_recompile_limit_through_its_logger():
    assert isinstance(compat.default_recompile_limit(), int), \
        'torch._dynamo.config.recompile_limit is gone (mmfsdp.compat.default_recompile_limit)'
    heard = []
    compat.on_recompile_limit(heard.append)
    compiled = torch.compile(lambda x: x + 1, backend='eager', dynamic=False, recompile_limit=1)
    for n in (2, 3):
        compiled(torch.ones(n))
    assert len(heard) == 1 and 'recompile_limit (1)' in heard[0], (
        "torch.compile no longer warns 'torch._dynamo hit config.recompile_limit' through "
        "the logger torch._dynamo.convert_frame (mmfsdp.compat.on_recompile_limit)")


def test_full_precision_switches_what_fsdp1_and_fsdp2_read_privately():
    """``compat.full_precision``: FSDP1's eval flag (state and handle); FSDP2's dtypes per
    parameter (from its own ``mp_policy``; before torch 2.15 its group's), gathered buffers
    made once, input casts by the state's ``_mp_policy``.
    The behaviour: tests/dist/test_compat.py."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import _runtime_utils as fsdp1_runtime
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    where = 'mmfsdp.compat.full_precision'
    assert 'state._use_full_prec_in_eval = ' in inspect.getsource(fsdp_init_utils) and \
        'self._use_full_prec_in_eval = ' in _source(FlatParamHandle.__init__), \
        f'FSDP1 no longer sets _use_full_prec_in_eval on its state and handle ({where})'
    assert 'self._use_full_prec_in_eval' in _source(FlatParamHandle._force_full_precision.fget) \
        and 'state._use_full_prec_in_eval' in _source(fsdp1_runtime._root_cast_forward_input), \
        f'FSDP1 no longer reads _use_full_prec_in_eval in eval mode ({where})'
    assert hasattr(FSDPModule, '_get_fsdp_state') and 'state._fsdp_param_groups' in _source(
        FSDPModule.reshard), f'FSDP2 no longer keeps its groups in _fsdp_param_groups ({where})'
    assert 'self._mp_policy.param_dtype' in _source(FSDPState._cast_forward_inputs), \
        f'FSDP2 no longer casts forward inputs by its state._mp_policy ({where})'
    # torch 2.15 reads each parameter's own policy, 2.13 / 2.14 the group's
    read = ('fsdp_param.mp_policy' if compat.FSDP2_POLICY_PER_PARAMETER else 'self.mp_policy')
    assert f'fsdp_param.init_dtype_attrs({read})' in _source(FSDPParamGroup._init_mp_dtypes) \
        and 'self._init_mp_dtypes()' in _source(FSDPParamGroup.lazy_init), \
        f"FSDP2's lazy init no longer sets the dtypes from {read} (torch {torch.__version__}; " \
        f'{where}, compat.set_fsdp2_param_policies)'
    assert 'self.mp_policy = mp_policy' in _source(FSDPParam.__init__), \
        f'FSDPParam no longer keeps its policy as mp_policy ({where}, compat.fsdp2_param_policies)'
    assert _parameters(FSDPParam.init_dtype_attrs) == ['self', 'mp_policy'] and \
        'self.param_dtype = param_dtype' in _source(FSDPParam.init_dtype_attrs), \
        f'FSDPParam.init_dtype_attrs changed ({where})'
    assert 'if len(self.all_gather_outputs) > 0:' in _source(FSDPParam.init_all_gather_outputs) \
        and 'if hasattr(self, "_unsharded_param"):' in _source(FSDPParam.init_unsharded_param), \
        f'FSDP2 no longer makes its gathered buffers once, as all_gather_outputs and ' \
        f'_unsharded_param ({where})'
