"""FlexibleRunner strategies: mmengine's ``strategy`` config, translated for ``FSDPRunner``.

OpenMMLab's large-model configs (mmpretrain's ViT-L/H FSDP and DeepSpeed
benchmarks, mmdet's ``projects/example_largemodel``) are written for mmengine's
``FlexibleRunner`` with ``strategy=dict(type='FSDPStrategy' | 'DeepSpeedStrategy',
...)``, a key the stock ``Runner`` ignores. :func:`translate_strategy` turns such
a config, once and without changing it, into mmfsdp's keys: a
``model_wrapper_cfg``, keys set on ``optim_wrapper`` and the checkpoint hook's
``state_dict_type``, with one line per strategy key for the log. A key with no
counterpart is refused, naming it, on every rank before any collective; tuning
knobs of DeepSpeed's own implementation whose job FSDP2 does itself are
accepted and logged as having nothing to set. The table: docs/configuration.md,
"From FlexibleRunner strategies".
"""
import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Tuple

from mmengine.optim import OptimWrapper
from mmengine.registry import FUNCTIONS
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from .amp import AmpOptimWrapper
from .options import check_keys, resolve_flag, suggest

__all__ = ['NO_STRATEGY', 'StrategyTranslation', 'translate_strategy']

FSDP2, FSDP1, DDP = 'mmfsdp.MMFullyShard', 'mmfsdp.MMFullyShardedDataParallel', \
    'mmfsdp.MMDistributedDataParallel'
#: ``BaseStrategy`` keywords that ``FlexibleRunner`` fills from the config: the config's own keys.
_RUNNER_KEYS = dict(work_dir='work_dir', experiment_name='experiment_name', env_kwargs='env_cfg',
                    log_kwargs='log_level / log_processor', auto_scale_lr='auto_scale_lr',
                    sync_bn='sync_bn')
_FSDP_REFUSED = dict(
    _RUNNER_KEYS,
    activation_checkpointing="a check_fn has no counterpart; name the layer classes in "
    "model_wrapper_cfg.activation_checkpointing=dict(layer_cls=[...]) (mmfsdp's own keys)")
_DS_REFUSED = dict(
    _RUNNER_KEYS,
    config='write its sections (zero_optimization, fp16, ...) as keys of strategy',
    amp="apex's AMP: use strategy.fp16 or bf16",
    activation_checkpointing="DeepSpeed's checkpointing API has no counterpart; name the layer "
    'classes in model_wrapper_cfg.activation_checkpointing (mmfsdp\'s own keys)',
    aio='NVMe offload has no counterpart', exclude_frozen_parameters='checkpoints hold every '
    'parameter')
#: ZeRO tuning knobs of DeepSpeed's implementation: FSDP2 all-gathers and reduce-scatters each
#: unit as one group, overlapped with compute, into its own buffers.
_ZERO_TUNING = ('allgather_partitions', 'reduce_scatter', 'allgather_bucket_size',
                'reduce_bucket_size', 'overlap_comm', 'contiguous_gradients', 'sub_group_size',
                'round_robin_gradients', 'stage3_prefetch_bucket_size',
                'stage3_param_persistence_threshold', 'stage3_max_live_parameters',
                'stage3_max_reuse_distance', 'elastic_checkpoint', 'load_from_fp32_weights')
_ZERO_KEYS = ('stage', 'cpu_offload', 'offload_param', 'offload_optimizer') + _ZERO_TUNING
#: DeepSpeed's ``zero_optimization.stage`` -> ``reshard_after_forward`` and why.
_STAGES = {3: (True, 'ZeRO-3: parameters, gradients and optimizer state sharded'),
           2: (False, 'ZeRO-2: gradients and optimizer state sharded, parameters kept from '
                      'forward to backward'),
           1: (False, 'nearest to ZeRO-1 (optimizer state sharded only): FSDP2 has no '
                      'optimizer-only sharding, so gradients are sharded too (ZeRO-2), for the '
                      'same communication per step')}
_FP16_KEYS = ('enabled', 'auto_cast', 'loss_scale', 'initial_scale_power', 'loss_scale_window',
              'hysteresis', 'consecutive_hysteresis', 'min_loss_scale',
              'fp16_master_weights_and_grads')
_STATE_DICT_TYPES = dict(full='full', local='sharded', sharded='sharded', FULL_STATE_DICT='full',
                         LOCAL_STATE_DICT='sharded', SHARDED_STATE_DICT='sharded')
_TORCH_POLICIES = {size_based_auto_wrap_policy: ('size_based', 'min_num_params'),
                   transformer_auto_wrap_policy: ('transformer', 'transformer_layer_cls')}
_TARGETS = dict(wrapper='model_wrapper_cfg', optim='optim_wrapper',
                checkpoint='default_hooks.checkpoint')


@dataclasses.dataclass(frozen=True)
class StrategyTranslation:
    """What a ``strategy`` stands for in mmfsdp's keys: the result of :func:`translate_strategy`."""

    #: The ``model_wrapper_cfg`` (with ``type``).
    model_wrapper_cfg: Mapping[str, Any]
    #: Keys set on ``optim_wrapper`` (``type``, ``dtype``, ``loss_scale``, ``clip_grad`` ...).
    optim_wrapper: Mapping[str, Any]
    #: Options of the checkpoint hook (``state_dict_type``).
    checkpoint: Mapping[str, Any]
    #: One ``'strategy.X → Y'`` line per key of the strategy, in order.
    lines: Tuple[str, ...]

    def log_block(self) -> str:
        """The lines as one log message."""
        return ('The config\'s strategy (a FlexibleRunner strategy) runs as mmfsdp\'s keys:\n  '
                + '\n  '.join(self.lines))

    def optim_wrapper_cfg(self, cfg: Any) -> Any:
        """The ``optim_wrapper`` config, or a copy with the translated keys set."""
        return dict(cfg, **self.optim_wrapper) if self.optim_wrapper and \
            isinstance(cfg, Mapping) else cfg

    def default_hooks(self, hooks: Optional[Mapping[str, Any]]) -> Optional[Mapping[str, Any]]:
        """``default_hooks``, or a copy whose checkpoint hook has the translated options."""
        if not self.checkpoint:
            return hooks
        hooks = dict(hooks or {})
        checkpoint = hooks.get('checkpoint', dict(type='CheckpointHook', interval=1))
        if isinstance(checkpoint, Mapping):  # None: no checkpoints at all
            hooks['checkpoint'] = dict(checkpoint, **self.checkpoint)
        return hooks


#: A config without ``strategy``: nothing translated.
NO_STRATEGY = StrategyTranslation({}, {}, {}, ())


class _Translating:
    """The translation being built: the three targets and the lines."""

    def __init__(self) -> None:
        self.out: Dict[str, Dict[str, Any]] = {target: {} for target in _TARGETS}
        self.lines: List[str] = []

    def set(self, src: str, target: str, key: str, value: Any, why: str = '') -> None:
        self.out[target][key] = value
        name = getattr(value, '__name__', None) if isinstance(value, type) else None
        src = src if src.startswith('optim_wrapper') else f'strategy.{src}'
        self.lines.append(f'{src} → {_TARGETS[target]}.{key}='
                          f'{name or repr(value)}' + (f' ({why})' if why else ''))

    def nothing(self, src: str, value: Any, why: str) -> None:
        self.lines.append(f'strategy.{src}={value!r} → nothing to set ({why})')

    def result(self) -> StrategyTranslation:
        return StrategyTranslation(self.out['wrapper'], self.out['optim'],
                                   self.out['checkpoint'], tuple(self.lines))


def _refuse(src: str, value: Any, why: str) -> None:
    raise ValueError(f'strategy.{src}={value!r} has no counterpart under mmfsdp.FSDPRunner: '
                     f'{why}')


def _check_keys(strategy: Mapping[str, Any], valid: Tuple[str, ...],
                refused: Mapping[str, str]) -> None:
    """An unknown key is a typo (``TypeError``); a key of ``refused`` has no counterpart."""
    check_keys(strategy, ('type', ) + valid + tuple(refused), 'strategy')
    for key in (k for k in refused if k in strategy):  # in a fixed order: the same on every rank
        _refuse(key, strategy[key], f'write the config key {_RUNNER_KEYS[key]} instead'
                if key in _RUNNER_KEYS else refused[key])


def _section(strategy: Mapping[str, Any], key: str, valid: Tuple[str, ...]) -> Mapping[str, Any]:
    value = strategy.get(key) or {}
    if not isinstance(value, Mapping):
        raise TypeError(f'strategy.{key}: expected a dict, got {type(value).__name__} {value!r}')
    check_keys(value, valid, f'strategy.{key}')
    return value


def _type_name(value: Any) -> Any:
    return getattr(value, '__name__', value)


def translate_strategy(cfg: Mapping[str, Any]) -> StrategyTranslation:
    """The config's ``strategy`` in mmfsdp's keys (:data:`NO_STRATEGY` when it has none).

    Raises ``ValueError`` / ``TypeError`` / ``KeyError`` naming the strategy key
    (or the config key it conflicts with), its value and the choices: a key
    with no counterpart, ``strategy`` beside ``model_wrapper_cfg``, an
    unknown strategy type, mmengine's ``DeepSpeedOptimWrapper`` without
    ``DeepSpeedStrategy``.
    """
    strategy, optim = cfg.get('strategy'), cfg.get('optim_wrapper')
    optim_type = _type_name(optim.get('type')) if isinstance(optim, Mapping) else None
    kind = _type_name(strategy.get('type')) if isinstance(strategy, Mapping) else None
    if optim_type == 'DeepSpeedOptimWrapper' and kind != 'DeepSpeedStrategy':
        raise ValueError("optim_wrapper.type='DeepSpeedOptimWrapper' is stepped by DeepSpeed's "
                         "engine, which only strategy=dict(type='DeepSpeedStrategy', ...) builds; "
                         "under mmfsdp.FSDPRunner write that strategy (translated) or "
                         "optim_wrapper.type='OptimWrapper' / 'mmfsdp.AmpOptimWrapper'")
    if strategy is None:
        return NO_STRATEGY
    if cfg.get('model_wrapper_cfg') is not None:
        raise ValueError("strategy and model_wrapper_cfg both say how to wrap the model: keep "
                         "strategy (FlexibleRunner's, translated) or model_wrapper_cfg "
                         "(mmfsdp's), not both")
    translating = _Translating()
    if kind == 'FSDPStrategy':
        _fsdp(strategy, cfg, translating)
    elif kind == 'DeepSpeedStrategy':
        _deepspeed(strategy, cfg, translating)
    else:
        choices = ['FSDPStrategy', 'DeepSpeedStrategy']
        raise KeyError(f'strategy.type: {kind!r} is not translated{suggest(kind, choices)}; '
                       f'FSDPRunner translates {choices}; for DDP remove strategy')
    return translating.result()


# ---- FSDPStrategy ---------------------------------------------------------------------------


def _fsdp(strategy: Mapping[str, Any], cfg: Mapping[str, Any], out: _Translating) -> None:
    """``FSDPStrategy``: FSDP2 unless ``model_wrapper.type`` names FSDP1."""
    _check_keys(strategy, ('model_wrapper', 'skip_init_weights', 'state_dict_cfg'),
                _FSDP_REFUSED)
    options = strategy.get('model_wrapper') or {}
    if not isinstance(options, Mapping):
        raise TypeError('strategy.model_wrapper: expected a dict of wrapper options, got '
                        f'{type(options).__name__} {options!r}')
    asked = _type_name(options.get('type'))
    versions = {None: FSDP2, 'MMFullyShard': FSDP2, FSDP2: FSDP2,
                'MMFullyShardedDataParallel': FSDP1, FSDP1: FSDP1}
    if asked not in versions:
        raise ValueError(f'strategy.model_wrapper.type: {asked!r} is not translated; leave it '
                         "out (FSDP2, mmfsdp.MMFullyShard) or write 'MMFullyShardedDataParallel' "
                         '(FSDP1, mmfsdp.MMFullyShardedDataParallel)')
    fsdp1 = versions[asked] == FSDP1
    out.set('type' if asked is None else 'model_wrapper.type', 'wrapper', 'type', versions[asked],
            'FSDP1, as model_wrapper.type asks' if fsdp1 else
            "FSDP2: torch's supported FSDP; model_wrapper.type='MMFullyShardedDataParallel' "
            'asks for FSDP1')
    for key, value in options.items():
        src = f'model_wrapper.{key}'
        if key == 'type':
            continue
        if key == 'param_init_fn':
            _refuse(src, value, "mmfsdp does not call it; strategy.skip_init_weights=True builds "
                    "the model on the meta device (model_wrapper_cfg.init_device='meta'), "
                    "materialises each shard and runs the model's init_weights")
        if key == 'auto_wrap_policy':
            out.set(src, 'wrapper', key, _policy(value, src))
        elif key == 'use_orig_params' and value is True:
            out.nothing(src, value, "mmfsdp's wrappers always keep the original parameters")
        elif key == 'cpu_offload' and not fsdp1:
            offload = bool(getattr(value, 'offload_params', value))
            out.set(src, 'wrapper', 'offload', dict(cpu_offload=offload))
        else:  # the same key in mmfsdp's wrapper (refused there if it has none)
            out.set(src, 'wrapper', key, value)
    if resolve_flag(strategy.get('skip_init_weights', False), 'strategy.skip_init_weights'):
        out.set('skip_init_weights', 'wrapper', 'init_device', 'meta',
                'meta init: each rank allocates its shards only; load_from fills the weights')
    if 'state_dict_cfg' in strategy:
        _state_dict_cfg(strategy['state_dict_cfg'], cfg, out)


def _policy(value: Any, src: str) -> Any:
    """An ``auto_wrap_policy`` as mmengine takes it: torch's two become mmfsdp's named ones."""
    fn, options = value, {}
    if isinstance(value, Mapping):
        fn, options = value.get('type'), {k: v for k, v in value.items() if k != 'type'}
    if isinstance(fn, str):  # as mmengine's MMFullyShardedDataParallel looks it up
        with FUNCTIONS.switch_scope_and_registry(None) as registry:
            found = registry.get(fn)
        if found is None:
            raise KeyError(f'strategy.{src}: {fn!r} is neither a registered function nor an '
                           'importable dotted name (e.g. '
                           "'torch.distributed.fsdp.wrap.size_based_auto_wrap_policy')")
        fn = found
    if not callable(fn):
        raise TypeError(f'strategy.{src}: expected a function, its name or dict(type=..., '
                        f'**options), got {type(fn).__name__} {fn!r}')
    if fn in _TORCH_POLICIES:
        name, argument = _TORCH_POLICIES[fn]
        if name == 'size_based':  # torch's default size
            options = dict(dict(min_num_params=int(1e8)), **options)
        else:
            options = {('layer_cls' if k == argument else k): v for k, v in options.items()}
        return dict(type=name, **options)
    return dict(type=fn, **options) if options else fn


def _state_dict_cfg(value: Any, cfg: Mapping[str, Any], out: _Translating) -> None:
    """``'full'`` stays full; ``'local'`` (per-rank files) becomes mmfsdp's sharded directory."""
    kind = value
    if isinstance(value, Mapping):
        check_keys(value, ('state_dict_type', ), 'strategy.state_dict_cfg')
        kind = _type_name(value.get('state_dict_type', 'LOCAL_STATE_DICT'))
    if not isinstance(kind, str) or kind not in _STATE_DICT_TYPES:
        raise ValueError(f'strategy.state_dict_cfg: {value!r} is not translated; valid choices '
                         f"are {list(_STATE_DICT_TYPES)} (or dict(state_dict_type=...))")
    checkpoint = (cfg.get('default_hooks') or {}).get('checkpoint')
    if isinstance(checkpoint, Mapping) and 'state_dict_type' in checkpoint:
        raise ValueError('strategy.state_dict_cfg and default_hooks.checkpoint.state_dict_type '
                         'both choose the checkpoint format: keep one')
    out.set('state_dict_cfg', 'checkpoint', 'state_dict_type', _STATE_DICT_TYPES[kind],
            'full: one file written by rank 0' if _STATE_DICT_TYPES[kind] == 'full' else
            "sharded: a directory of every rank's shards, loadable at any world size")


# ---- DeepSpeedStrategy ----------------------------------------------------------------------


def _deepspeed(strategy: Mapping[str, Any], cfg: Mapping[str, Any], out: _Translating) -> None:
    """``DeepSpeedStrategy``: ZeRO stage -> FSDP2 resharding, fp16 / bf16 -> AMP."""
    _check_keys(strategy, ('zero_optimization', 'fp16', 'bf16', 'inputs_to_half',
                           'gradient_clipping', 'gradient_accumulation_steps',
                           'train_micro_batch_size_per_gpu', 'steps_per_print'), _DS_REFUSED)
    _zero(_section(strategy, 'zero_optimization', _ZERO_KEYS), out)
    optim_cfg = cfg.get('optim_wrapper') or {}
    if _type_name(optim_cfg.get('type')) not in (None, 'DeepSpeedOptimWrapper'):
        raise ValueError(f"optim_wrapper.type={optim_cfg['type']!r}: DeepSpeedStrategy steps "
                         "through optim_wrapper.type='DeepSpeedOptimWrapper', which FSDPRunner "
                         'translates with the strategy; write that')
    low = _precision(strategy, out)
    out.set('optim_wrapper.type', 'optim', 'type', AmpOptimWrapper if low else OptimWrapper,
            'DeepSpeedOptimWrapper replaced; constructor and paramwise_cfg kept')
    if strategy.get('inputs_to_half') is not None:
        if low != 'float16':
            _refuse('inputs_to_half', strategy['inputs_to_half'], 'it applies with fp16 only')
        out.nothing('inputs_to_half', strategy['inputs_to_half'],
                    'autocast runs each op of the forward in float16')
    for src, key, value in (('gradient_clipping', 'clip_grad', dict(max_norm=strategy.get(
            'gradient_clipping'))), ('gradient_accumulation_steps', 'accumulative_counts',
                                     strategy.get('gradient_accumulation_steps'))):
        if strategy.get(src) is None:
            continue
        if key in optim_cfg:
            raise ValueError(f'strategy.{src} and optim_wrapper.{key} both set it: keep one')
        out.set(src, 'optim', key, value, 'by the norm over all shards' if key == 'clip_grad'
                else '')
    batch = strategy.get('train_micro_batch_size_per_gpu')
    loader_batch = (cfg.get('train_dataloader') or {}).get('batch_size')
    if batch is not None and batch != loader_batch:
        raise ValueError(f'strategy.train_micro_batch_size_per_gpu={batch!r} differs from '
                         f'train_dataloader.batch_size={loader_batch!r}, which sets it under '
                         'FSDPRunner: remove it')
    if batch is not None:
        out.nothing('train_micro_batch_size_per_gpu', batch, 'train_dataloader.batch_size')
    if 'steps_per_print' in strategy:
        out.nothing('steps_per_print', strategy['steps_per_print'],
                    "mmengine's LoggerHook interval sets what is logged")


def _zero(zero: Mapping[str, Any], out: _Translating) -> None:
    """The ZeRO stage as FSDP2's ``reshard_after_forward`` (stage 0: DDP); offload; knobs."""
    stage = zero.get('stage', 0)
    if stage == 0:
        out.set('zero_optimization.stage', 'wrapper', 'type', DDP, 'ZeRO disabled: replicated')
    elif stage in _STAGES:
        out.set('zero_optimization.stage', 'wrapper', 'type', FSDP2)
        out.set('zero_optimization.stage', 'wrapper', 'reshard_after_forward', *_STAGES[stage])
    else:
        raise ValueError(f'strategy.zero_optimization.stage: {stage!r} is not a ZeRO stage; '
                         'valid choices are 0, 1, 2, 3')
    devices = {k: (zero[k] or {}).get('device', 'none') if isinstance(zero[k], Mapping)
               else ('cpu' if zero[k] else 'none') for k in ('cpu_offload', 'offload_param',
                                                         'offload_optimizer') if k in zero}
    for key, device in devices.items():
        if device not in ('cpu', 'none'):
            _refuse(f'zero_optimization.{key}.device', device, "only 'cpu' is offloaded to")
        if 'cpu' in devices.values():
            out.set(f'zero_optimization.{key}', 'wrapper', 'offload', dict(cpu_offload=True),
                    'FSDP2 keeps parameters, gradients and optimizer state on the CPU together')
        else:
            out.nothing(f'zero_optimization.{key}', zero[key], 'no offload, the default')
    for key in _ZERO_TUNING:
        if key in zero:
            out.nothing(f'zero_optimization.{key}', zero[key],
                        'tuning of DeepSpeed\'s buckets: FSDP2 communicates each unit as one '
                        'group, overlapped with compute')


def _precision(strategy: Mapping[str, Any], out: _Translating) -> Optional[str]:
    """``fp16`` / ``bf16`` -> ``AmpOptimWrapper`` dtype and loss scaling; the dtype or None."""
    fp16 = _section(strategy, 'fp16', _FP16_KEYS)
    bf16 = _section(strategy, 'bf16', ('enabled', ))
    if fp16.get('enabled') and bf16.get('enabled'):
        raise ValueError('strategy.fp16 and strategy.bf16 are both enabled: enable one')
    if bf16.get('enabled'):
        out.set('bf16.enabled', 'optim', 'dtype', 'bfloat16', 'autocast; fp32 master weights')
        out.set('bf16', 'optim', 'loss_scale', dict(enabled=False),
                "DeepSpeed's bf16 does not scale the loss")
        return 'bfloat16'
    if not fp16.get('enabled'):
        return None
    if fp16.get('fp16_master_weights_and_grads'):
        _refuse('fp16.fp16_master_weights_and_grads', True, 'AMP keeps fp32 master weights')
    if 'fp16_master_weights_and_grads' in fp16:
        out.nothing('fp16.fp16_master_weights_and_grads', False, 'AMP keeps fp32 master weights')
    out.set('fp16.enabled', 'optim', 'dtype', 'float16', 'autocast; fp32 master weights')
    if fp16.get('loss_scale', 0):
        out.set('fp16.loss_scale', 'optim', 'loss_scale', float(fp16['loss_scale']), 'fixed')
    else:  # DeepSpeed's defaults: 2**16, window 1000
        out.set('fp16.loss_scale/initial_scale_power/loss_scale_window', 'optim', 'loss_scale',
                dict(init_scale=2.0**fp16.get('initial_scale_power', 16),
                     growth_interval=fp16.get('loss_scale_window', 1000)),
                "dynamic: torch's GradScaler, ×2 after the window, ×0.5 at an overflow")
    for key in ('hysteresis', 'consecutive_hysteresis', 'min_loss_scale'):
        if key in fp16:
            out.nothing(f'fp16.{key}', fp16[key], "nearest: torch's GradScaler halves the scale "
                        'at every overflow and has no floor')
    if 'auto_cast' in fp16:
        out.nothing('fp16.auto_cast', fp16['auto_cast'], 'autocast casts the inputs of each op')
    return 'float16'
