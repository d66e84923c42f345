"""FlexibleRunner strategies: mmengine's ``strategy`` config, translated for ``FSDPRunner``.

OpenMMLab's large-model configs (mmpretrain's ViT-L/H FSDP and DeepSpeed benchmarks,
mmdet's ``projects/example_largemodel``) are written for mmengine's ``FlexibleRunner`` with
``strategy=dict(type='FSDPStrategy' | 'DeepSpeedStrategy', ...)``, a key the stock
``Runner`` ignores. :func:`translate_strategy` turns it, once and without changing the
config, into mmfsdp's keys (``model_wrapper_cfg``, keys of ``optim_wrapper``, the checkpoint
hook's ``state_dict_type``), with one log line per strategy key. The tables below say which
keys translate, which are accepted with nothing to set (logged with why) and which are
refused (naming the key, its value and what to write instead), on every rank before any
collective. Values go on as written: the wrapper's and the optim wrapper's resolvers check
them where they land. The whole table: docs/configuration.md, "From FlexibleRunner
strategies".
"""
import dataclasses
from typing import Any, Dict, List, Mapping, Optional

from mmengine.optim import OptimWrapper
from mmengine.registry import FUNCTIONS
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from .amp import AmpOptimWrapper
from .options import check_keys, option_dict, resolve_flag, suggest

__all__ = ['NO_STRATEGY', 'StrategyTranslation', 'translate_strategy']

FSDP2, FSDP1 = 'mmfsdp.MMFullyShard', 'mmfsdp.MMFullyShardedDataParallel'
#: ``FSDPStrategy``'s ``model_wrapper.type`` (mmengine's FSDP1 wrapper's name) -> the wrapper.
_WRAPPERS = {None: FSDP2, 'MMFullyShard': FSDP2, FSDP2: FSDP2,
             'MMFullyShardedDataParallel': FSDP1, FSDP1: FSDP1}
#: ``zero_optimization.stage`` -> ``model_wrapper_cfg``. DeepSpeed takes no wrap policy
#: (ZeRO-3 gathers parameter by parameter): the units are the model's repeated blocks.
_STAGES = {0: dict(type='mmfsdp.MMDistributedDataParallel'), **{
    stage: dict(type=FSDP2, reshard_after_forward=stage == 3, auto_wrap_policy='auto')
    for stage in (1, 2, 3)}}
_FORMATS = dict(full='full', local='sharded', sharded='sharded')  # or 'FULL_STATE_DICT', ...


def _keys(names: str, why: Optional[str] = None) -> Dict[str, Optional[str]]:
    return dict.fromkeys(names.split(), why)


_SCALER = "nearest: torch's GradScaler halves the scale at every overflow and has no floor"
#: ``DeepSpeedStrategy``'s keys by section (``''``: the strategy itself): ``None`` where
#: translated, else why there is nothing to set (logged).
_DEEPSPEED = {
    '': dict(_keys('zero_optimization fp16 bf16 gradient_clipping gradient_accumulation_steps'),
             inputs_to_half='autocast runs each op of the forward in float16',
             train_micro_batch_size_per_gpu='train_dataloader.batch_size sets it',
             steps_per_print="mmengine's LoggerHook interval sets what is logged"),
    'zero_optimization': dict(_keys('stage cpu_offload offload_param offload_optimizer'), **_keys(
        'allgather_partitions reduce_scatter allgather_bucket_size reduce_bucket_size overlap_comm'
        ' contiguous_gradients sub_group_size round_robin_gradients stage3_prefetch_bucket_size '
        'stage3_param_persistence_threshold stage3_max_live_parameters stage3_max_reuse_distance'
        ' elastic_checkpoint load_from_fp32_weights', "tuning of DeepSpeed's buckets: FSDP2 "
        'communicates each unit as one group, overlapped with compute')),
    'bf16': _keys('enabled'),
    'fp16': dict(_keys('enabled loss_scale initial_scale_power loss_scale_window'),
                 **_keys('hysteresis consecutive_hysteresis min_loss_scale', _SCALER),
                 fp16_master_weights_and_grads='AMP keeps fp32 master weights',
                 auto_cast='autocast casts the inputs of each op')}
#: Per strategy type: its keys, and those refused with what to write instead (besides the
#: keywords that ``FlexibleRunner`` fills from the config's own keys, and a ``check_fn``).
_KEYS = dict(FSDPStrategy=(_keys('model_wrapper skip_init_weights state_dict_cfg'), {}),
             DeepSpeedStrategy=(_DEEPSPEED[''], dict(
                 config='its sections (zero_optimization, fp16, ...) as keys of strategy',
                 amp='strategy.fp16 or bf16 (not apex)', aio="offload_param=dict(device='cpu')",
                 exclude_frozen_parameters='nothing (checkpoints hold every parameter)')))
_REFUSED = dict({k: f'the config key {v}' for k, v in dict(
    env_kwargs='env_cfg', log_kwargs='log_level / log_processor',
    **{k: k for k in 'work_dir experiment_name auto_scale_lr sync_bn'.split()}).items()},
    activation_checkpointing='model_wrapper_cfg.activation_checkpointing=dict(layer_cls=[...])')


@dataclasses.dataclass(frozen=True)
class StrategyTranslation:
    """What a ``strategy`` stands for in mmfsdp's keys: the result of :func:`translate_strategy`."""

    #: The ``model_wrapper_cfg`` (with ``type``).
    model_wrapper_cfg: Dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Keys set on ``optim_wrapper`` (``type``, ``dtype``, ``loss_scale``, ``clip_grad`` ...).
    optim_wrapper: Dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Options of the checkpoint hook (``state_dict_type``).
    checkpoint: Dict[str, Any] = dataclasses.field(default_factory=dict)
    #: One ``'strategy.X → Y'`` line per key of the strategy, in order.
    lines: List[str] = dataclasses.field(default_factory=list)
    #: The config's own ``optim_wrapper`` and checkpoint hook: a key set in both is refused.
    given: Dict[str, Mapping] = dataclasses.field(default_factory=dict, repr=False)

    def log_block(self) -> str:
        """The lines as one log message."""
        return ('The config\'s strategy (a FlexibleRunner strategy) runs as mmfsdp\'s keys:\n  '
                + '\n  '.join(self.lines))

    def optim_wrapper_cfg(self, cfg: Any) -> Any:
        """The ``optim_wrapper`` config, or a copy with the translated keys set."""
        return dict(cfg, **self.optim_wrapper) if self.optim_wrapper and \
            isinstance(cfg, Mapping) else cfg

    def default_hooks(self, hooks: Any) -> Any:
        """``default_hooks``, or a copy whose checkpoint hook has the translated options."""
        checkpoint = (hooks or {}).get('checkpoint', dict(type='CheckpointHook', interval=1))
        if not self.checkpoint or not isinstance(checkpoint, Mapping):  # None: no checkpoints
            return hooks
        return dict(hooks or {}, checkpoint=dict(checkpoint, **self.checkpoint))

    def _set(self, src: str, target: str, values: Mapping[str, Any], why: str = '') -> None:
        """Set ``values`` in the field ``target`` for the strategy key ``src``, in one line."""
        getattr(self, target).update(values)
        target = 'default_hooks.checkpoint' if target == 'checkpoint' else target
        for key in (k for k in values if k != 'type' and k in self.given.get(target, {})):
            raise ValueError(f'strategy.{src} and {target}.{key} both set it: keep one')
        self.lines.append(f'{src if src.startswith("optim") else "strategy." + src} → ' + ', '.join(
            f'{target}.{k}={getattr(v, "__name__", None) if isinstance(v, type) else repr(v)}'
            for k, v in values.items()) + (f' ({why})' if why else ''))

    def _nothing(self, src: str, value: Any, why: str) -> None:
        self.lines.append(f'strategy.{src}={value!r} → nothing to set ({why})')


#: A config without ``strategy``: nothing translated.
NO_STRATEGY = StrategyTranslation()


def _refuse(src: str, value: Any, why: str) -> None:
    raise ValueError(f'strategy.{src}={value!r} has no counterpart under mmfsdp.FSDPRunner: {why}')


def _name(value: Any) -> Any:
    return getattr(value, '__name__', value)


def translate_strategy(cfg: Mapping[str, Any]) -> StrategyTranslation:
    """The config's ``strategy`` in mmfsdp's keys (:data:`NO_STRATEGY` when it has none).

    Raises ``ValueError`` / ``TypeError`` / ``KeyError`` naming the strategy key
    (or the config key it conflicts with), its value and what to write instead.
    """
    strategy, optim = cfg.get('strategy'), cfg.get('optim_wrapper')
    optim = optim if isinstance(optim, Mapping) else {}
    kind = _name(strategy.get('type')) if isinstance(strategy, Mapping) else None
    ds_optim = _name(optim.get('type')) == 'DeepSpeedOptimWrapper'
    if ds_optim != (kind == 'DeepSpeedStrategy') and (ds_optim or 'type' in optim):
        raise ValueError(f"optim_wrapper.type={optim['type']!r}: DeepSpeedStrategy and "
                         "'DeepSpeedOptimWrapper' go together (translated); else 'OptimWrapper'")
    if strategy is None:
        return NO_STRATEGY
    if cfg.get('model_wrapper_cfg') is not None:
        raise ValueError('strategy and model_wrapper_cfg both say how to wrap the model: keep one')
    if kind not in _KEYS:
        raise KeyError(f'strategy.type: {kind!r} is not translated{suggest(kind, _KEYS)}; '
                       f'FSDPRunner translates {list(_KEYS)}; for DDP remove strategy')
    refused = dict(_REFUSED, **_KEYS[kind][1])
    check_keys(strategy, ('type', *_KEYS[kind][0], *refused), 'strategy')
    for key in (k for k in refused if k in strategy):  # in a fixed order: the same on every rank
        _refuse(key, strategy[key], f'write {refused[key]} instead')
    checkpoint = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    out = StrategyTranslation(given={'optim_wrapper': optim,
                                     'default_hooks.checkpoint': checkpoint})
    (_fsdp if kind == 'FSDPStrategy' else _deepspeed)(strategy, cfg, out)
    return out


def _fsdp(strategy: Mapping, cfg: Mapping, out: StrategyTranslation) -> None:
    """``FSDPStrategy``: FSDP2 unless ``model_wrapper.type`` names FSDP1; options as written."""
    options = strategy.get('model_wrapper') or {}
    if not isinstance(options, Mapping):
        raise TypeError(f'strategy.model_wrapper: expected a dict of options, got {options!r}')
    wrapper = _WRAPPERS.get(_name(options.get('type')))
    if wrapper is None:
        raise ValueError(f"strategy.model_wrapper.type: {options['type']!r} is not translated; "
                         "leave it out (FSDP2) or write 'MMFullyShardedDataParallel' (FSDP1)")
    out._set('model_wrapper.type' if 'type' in options else 'type', 'model_wrapper_cfg',
             dict(type=wrapper))
    for key, value in options.items():
        src = f'model_wrapper.{key}'
        if key == 'param_init_fn':
            _refuse(src, value, 'mmfsdp does not call it; write strategy.skip_init_weights=True')
        elif key == 'use_orig_params' and value is True:
            out._nothing(src, value, 'always so')
        elif key == 'cpu_offload' and wrapper == FSDP2:
            out._set(src, 'model_wrapper_cfg', dict(offload=dict(
                cpu_offload=bool(getattr(value, 'offload_params', value)))))
        elif key != 'type':  # the same key of the wrapper, which resolves (or refuses) it
            out._set(src, 'model_wrapper_cfg',
                     {key: _policy(value, src) if key == 'auto_wrap_policy' else value})
    if resolve_flag(strategy.get('skip_init_weights', False), 'strategy.skip_init_weights'):
        out._set('skip_init_weights', 'model_wrapper_cfg', dict(init_device='meta'))
    value = strategy.get('state_dict_cfg')
    if value is not None:
        kind = option_dict(value, ['state_dict_type'], 'strategy.state_dict_cfg', '').get(
            'state_dict_type', 'local') if isinstance(value, Mapping) else value
        kind = _FORMATS.get(str(getattr(kind, 'name', kind)).lower().replace('_state_dict', ''))
        if kind is None:
            raise ValueError(f'strategy.state_dict_cfg: {value!r} is not translated; valid '
                             f'choices are {list(_FORMATS)} or dict(state_dict_type=...)')
        out._set('state_dict_cfg', 'checkpoint', dict(state_dict_type=kind))


def _policy(value: Any, src: str) -> Any:
    """An ``auto_wrap_policy`` as mmengine takes it: torch's two become mmfsdp's named ones."""
    fn, options = value, {}
    if isinstance(value, Mapping):
        fn, options = value.get('type'), {k: v for k, v in value.items() if k != 'type'}
    if isinstance(fn, str):  # as mmengine's MMFullyShardedDataParallel looks it up
        with FUNCTIONS.switch_scope_and_registry(None) as registry:
            fn = registry.get(fn) or fn
        if isinstance(fn, str):
            raise KeyError(f'strategy.{src}: {fn!r} is neither a registered function nor an '
                           'importable dotted name')
    if fn is size_based_auto_wrap_policy:
        return {'type': 'size_based', 'min_num_params': int(1e8), **options}  # torch's default
    if fn is transformer_auto_wrap_policy:
        return dict(type='transformer', **{'layer_cls' if k == 'transformer_layer_cls' else k: v
                                           for k, v in options.items()})
    return dict(type=fn, **options) if options else fn  # the policy resolver checks it


def _deepspeed(strategy: Mapping, cfg: Mapping, out: StrategyTranslation) -> None:
    """``DeepSpeedStrategy``: ZeRO stage -> FSDP2 resharding, fp16 / bf16 -> AMP."""
    sections = {k: option_dict(strategy.get(k) or {}, keys, f'strategy.{k}', 'a dict') if k
                else strategy for k, keys in _DEEPSPEED.items()}
    zero, fp16, bf16 = (sections[k] for k in ('zero_optimization', 'fp16', 'bf16'))
    stage = zero.get('stage', 0)
    if stage not in _STAGES:
        raise ValueError(f'strategy.zero_optimization.stage: {stage!r} is not a ZeRO stage; '
                         'valid choices are 0, 1, 2, 3')
    out._set('zero_optimization.stage', 'model_wrapper_cfg', _STAGES[stage], 'the nearest: '
             'FSDP2 has no optimizer-only sharding' if stage == 1 else '')
    for key in (k for k in ('cpu_offload', 'offload_param', 'offload_optimizer') if k in zero):
        device = zero[key].get('device') if isinstance(zero[key], Mapping) else zero[key] and 'cpu'
        if device not in ('cpu', 'none', False, None):
            _refuse(f'zero_optimization.{key}.device', device, "only 'cpu' is offloaded to")
        if device == 'cpu':
            out._set(f'zero_optimization.{key}', 'model_wrapper_cfg', dict(offload=dict(
                cpu_offload=True)))
        else:
            out._nothing(f'zero_optimization.{key}', zero[key], 'no offload, the default')
    if fp16.get('enabled') and bf16.get('enabled'):
        raise ValueError('strategy.fp16 and strategy.bf16 are both enabled: enable one')
    low = 'bf16' if bf16.get('enabled') else 'fp16' if fp16.get('enabled') else None
    out._set('optim_wrapper.type', 'optim_wrapper', dict(type=AmpOptimWrapper if low else
                                                         OptimWrapper), 'the rest kept')
    if low == 'bf16':
        out._set('bf16.enabled', 'optim_wrapper', dict(dtype='bfloat16', loss_scale=dict(
            enabled=False)), 'autocast, fp32 master weights, no loss scaling')
    elif low:
        out._set('fp16.enabled', 'optim_wrapper', dict(dtype='float16'), 'autocast, fp32 master '
                 'weights')
        fixed = fp16.get('loss_scale')  # else dynamic, with DeepSpeed's defaults
        out._set('fp16.loss_scale' + ('' if fixed else '/initial_scale_power/loss_scale_window'),
                 'optim_wrapper', dict(loss_scale=float(fixed) if fixed else dict(
                     init_scale=2.0**fp16.get('initial_scale_power', 16),
                     growth_interval=fp16.get('loss_scale_window', 1000))))
    for src, key in (('gradient_clipping', 'clip_grad'),
                     ('gradient_accumulation_steps', 'accumulative_counts')):
        if strategy.get(src) is not None:
            out._set(src, 'optim_wrapper', {key: dict(max_norm=strategy[src]) if key ==
                                            'clip_grad' else strategy[src]})
    batch = (cfg.get('train_dataloader') or {}).get('batch_size')
    if strategy.get('inputs_to_half') is not None and low != 'fp16':
        _refuse('inputs_to_half', strategy['inputs_to_half'], 'it applies with fp16 only')
    if fp16.get('fp16_master_weights_and_grads'):
        _refuse('fp16.fp16_master_weights_and_grads', True, 'AMP keeps fp32 master weights')
    if strategy.get('train_micro_batch_size_per_gpu') not in (None, batch):
        _refuse('train_micro_batch_size_per_gpu', strategy['train_micro_batch_size_per_gpu'],
                f'train_dataloader.batch_size={batch!r} sets it; remove it')
    for section, keys in _DEEPSPEED.items():
        for key in (k for k, why in keys.items() if why and k in sections[section]):
            out._nothing(f'{section}.{key}'.lstrip('.'), sections[section][key], keys[key])
