"""FlexibleRunner strategies: mmengine's ``strategy`` config, translated for ``FSDPRunner``.

OpenMMLab's large-model configs (mmpretrain's ViT-L/H FSDP and DeepSpeed benchmarks,
mmdet's ``projects/example_largemodel``) are written for mmengine's ``FlexibleRunner`` with
``strategy=dict(type='FSDPStrategy' | 'DeepSpeedStrategy', ...)``, a key the stock
``Runner`` ignores. XTuner's DeepSpeed form (its subclass of mmengine's ``DeepSpeedStrategy``,
a DeepSpeed JSON as ``config`` with ``"auto"`` values) is read with DeepSpeed's meaning.
:func:`translate_strategy` turns it, once and without changing the config, into mmfsdp's
keys (``model_wrapper_cfg``, keys of ``optim_wrapper``, the checkpoint hook's
``state_dict_type``), with one log line per strategy key. The tables below say which
keys translate, which are accepted with nothing to set (logged with why) and which are
refused (naming the key, its value and what to write instead), on every rank before any
collective. Values go on as written: the wrapper's and the optim wrapper's resolvers check
them where they land. The whole table: docs/configuration.md, "From FlexibleRunner
strategies".
"""
import dataclasses
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
from mmengine.optim import OptimWrapper
from mmengine.registry import FUNCTIONS
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from .amp import AmpOptimWrapper
from .dist import current_device
from .options import check_keys, option_dict, resolve_flag, suggest
from .wrappers.fsdp import resolve_cpu_offload

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
#: mmengine's ``state_dict_cfg=dict(...)`` keys (``FSDPStrategy._init_state_dict_cfg``).
_STATE_DICT_CFG = ('state_dict_type', 'state_dict_config', 'optim_state_dict_config')


def _keys(names: str, why: Optional[str] = None) -> Dict[str, Optional[str]]:
    return dict.fromkeys(names.split(), why)


_SCALER = "nearest: torch's GradScaler halves the scale at every overflow and has no floor"
#: ``DeepSpeedStrategy``'s keys by section (``''``: the strategy itself): ``None`` where
#: translated, else why there is nothing to set (logged).
_DEEPSPEED = {
    '': dict(_keys('zero_optimization fp16 bf16 gradient_clipping gradient_accumulation_steps '
                   'sequence_parallel_size'),
             inputs_to_half='autocast runs each op of the forward in float16',
             train_micro_batch_size_per_gpu='train_dataloader.batch_size sets it',
             steps_per_print="mmengine's LoggerHook interval sets what is logged",
             activation_checkpointing="DeepSpeed's section configures deepspeed.checkpointing, "
             "which only the model's own code calls; to recompute layers write "
             'model_wrapper_cfg.activation_checkpointing in place of strategy',
             exclude_frozen_parameters="checkpoints hold what the model's state_dict() returns "
             "(XTuner's LoRA models return their adapter); training is the same either way"),
    'zero_optimization': dict(
        _keys('stage cpu_offload offload_param offload_optimizer'),
        stage3_gather_16bit_weights_on_model_save="how DeepSpeed's save_16bit_model gathers "
        "ZeRO-3 weights; mmfsdp's checkpoint hook writes full or sharded weights by its "
        'state_dict_type', **_keys(
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
#: Keys of a DeepSpeed ``config`` (a dict or JSON file) that are no ``DeepSpeedStrategy``
#: keyword, with DeepSpeed's meaning of each (``None``: checked in :func:`_deepspeed`).
_JSON = dict(
    train_batch_size=None, optimizer=None, scheduler=None,
    zero_allow_untested_optimizer="lets DeepSpeed's ZeRO step an optimizer it has not tested; "
    "FSDP2 shards the state of any torch optimizer",
    zero_force_ds_cpu_optimizer="DeepSpeed's check that an offloaded optimizer is its own CPU "
    "Adam; FSDPRunner steps the config's optimizer",
    wall_clock_breakdown="DeepSpeed's timing printout", dump_state="DeepSpeed's printout of its "
    'engine state', low_cpu_mem_usage='DeepSpeed does not read it: a transformers loading option')
#: ``DeepSpeedStrategy``'s keywords that replace the same section of its ``config`` when not
#: ``None`` (mmengine 0.10.7 ``DeepSpeedStrategy.__init__``, the whole section, not merged).
_SECTIONS = ('zero_optimization gradient_clipping fp16 bf16 amp activation_checkpointing aio '
             'train_micro_batch_size_per_gpu gradient_accumulation_steps steps_per_print').split()
_AUTO = 'auto'  # DeepSpeed's 'take it from the trainer' (HF's and XTuner's JSONs): the config's
#: ``offload_param`` / ``offload_optimizer`` keys besides ``device`` and ``pin_memory``: what
#: DeepSpeed tunes its own CPU / NVMe buffers with (``ratio`` is checked apart).
_OFFLOAD_TUNING = 'nvme_path buffer_count buffer_size max_in_cpu pipeline_read pipeline_write ' \
    'fast_init'
#: Per strategy type: its keys, and those refused with what to write instead (besides the
#: keywords that ``FlexibleRunner`` fills from the config's own keys). Each is refused only
#: when set: mmengine's default for all of them is ``None``, logged as unset.
_KEYS = dict(FSDPStrategy=(_keys('model_wrapper skip_init_weights state_dict_cfg'), dict(
                 activation_checkpointing='strategy.model_wrapper.activation_checkpointing='
                 'dict(layer_cls=[...]) (the classes to recompute; a check_fn is not taken)')),
             DeepSpeedStrategy=(dict(_DEEPSPEED[''], config=None), dict(
                 amp='strategy.fp16 or bf16 (not apex)', aio="offload_param=dict(device='cpu')")))
_REFUSED = {k: f'the config key {v}' for k, v in dict(
    env_kwargs='env_cfg', log_kwargs='log_level / log_processor',
    **{k: k for k in 'work_dir experiment_name auto_scale_lr sync_bn'.split()}).items()}


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
    kind, how = _kind(strategy.get('type')) if isinstance(strategy, Mapping) else (None, None)
    if _name(optim.get('type')) == 'DeepSpeedOptimWrapper' and kind != 'DeepSpeedStrategy':
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
    lines = [] if how is None else [f'strategy.type={how} → read as mmengine\'s {kind} (its keys '
                                    'keep their meaning)']
    if kind == 'DeepSpeedStrategy':
        strategy = _with_config(strategy, lines)
    for key in (k for k in refused if strategy.get(k) is not None):  # the same order on all ranks
        _refuse(key, strategy[key], f'write {refused[key]} instead')
    checkpoint = (cfg.get('default_hooks') or {}).get('checkpoint') or {}
    out = StrategyTranslation(lines=lines, given={'optim_wrapper': optim,
                                                  'default_hooks.checkpoint': checkpoint})
    for key in (k for k in refused if k in strategy):  # each None: mmengine's default
        out._nothing(key, None, "mmengine's default, unset")
    (_fsdp if kind == 'FSDPStrategy' else _deepspeed)(strategy, cfg, out)
    return out


def _kind(value: Any) -> Tuple[Optional[str], Optional[str]]:
    """The translated strategy ``type`` names, and the name to log where it is not that name.

    A class is read as the nearest class of its MRO named in :data:`_KEYS` (XTuner's
    ``xtuner.engine.DeepSpeedStrategy`` subclasses mmengine's); a dotted name of mmengine or
    XTuner (``'xtuner.engine.DeepSpeedStrategy'``) as its last part. XTuner is not imported:
    its ``--deepspeed`` writes the class itself, which the config builds when read.
    """
    if isinstance(value, type):
        base = next((c.__name__ for c in value.__mro__ if c.__name__ in _KEYS), value.__name__)
        own = value.__name__ == base and value.__module__.split('.')[0] == 'mmengine'
        return base, None if own else f'{value.__module__}.{value.__qualname__}'
    if isinstance(value, str) and value.split('.')[0] in ('mmengine', 'xtuner') and \
            value.rpartition('.')[2] in _KEYS:
        return value.rpartition('.')[2], value
    return value, None


def _with_config(strategy: Mapping, lines: List[str]) -> Mapping:
    """``DeepSpeedStrategy``'s keys with its ``config`` (a dict or a JSON file) merged in.

    As mmengine 0.10.7 merges them: a keyword of the strategy that is not ``None`` replaces
    the config's whole section of that name; the config's other keys stand. Read with
    ``json``, nothing executed.
    """
    config = strategy.get('config')
    if config is None:
        return strategy
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding='utf-8') as f:
                config = json.load(f)
        except OSError as e:
            raise ValueError(f"strategy.config={strategy['config']!r}: cannot read it "
                             f'({e.strerror}); write the path of a DeepSpeed JSON file (XTuner '
                             'ships them in xtuner/configs/deepspeed/) or a dict') from None
        except ValueError as e:
            raise ValueError(f"strategy.config={strategy['config']!r} is not JSON: {e}") from None
    option_dict(config, (*_SECTIONS, *_JSON), 'strategy.config',
                'a dict or the path of a DeepSpeed JSON file')
    merged = {k: v for k, v in strategy.items() if k != 'config'}
    replaced = [k for k in config if merged.get(k) is not None]
    merged.update((k, v) for k, v in config.items() if merged.get(k) is None)
    lines.append(f'strategy.config={_short(strategy["config"])} → its keys {list(config)} read '
                 'as keys of strategy' + (f' (strategy.{", strategy.".join(replaced)} replace '
                                          "the config's, as mmengine merges them)" if replaced
                                          else ''))
    return merged


def _short(value: Any) -> str:
    return repr(value) if not isinstance(value, Mapping) else 'dict(...)'


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
        elif key == 'device_id':
            _device_id(value, out)
        elif key == 'cpu_offload' and wrapper == FSDP2:  # read as FSDP1 reads it (pinned memory)
            out._set(src, 'model_wrapper_cfg', dict(offload=dict(
                cpu_offload=resolve_cpu_offload(value).offload_params)))
        elif key != 'type':  # the same key of the wrapper, which resolves (or refuses) it
            out._set(src, 'model_wrapper_cfg',
                     {key: _policy(value, src) if key == 'auto_wrap_policy' else value})
    if resolve_flag(strategy.get('skip_init_weights', False), 'strategy.skip_init_weights'):
        out._set('skip_init_weights', 'model_wrapper_cfg', dict(init_device='meta'))
    _state_dict_cfg(strategy.get('state_dict_cfg'), out)


def _device_id(value: Any, out: StrategyTranslation) -> None:
    """FSDP1's ``device_id``: mmengine passes ``LOCAL_RANK``; CPU users write the CPU."""
    here = current_device()
    try:
        named = torch.device(here.type if here.type != 'cpu' and isinstance(value, int)
                             and not isinstance(value, bool) else value)
    except (RuntimeError, TypeError):
        named = None
    if named is None or named.type != here.type:
        _refuse('model_wrapper.device_id', value, f'this process trains on {here} (its '
                "accelerator by LOCAL_RANK, else the CPU); remove it")
    out._nothing('model_wrapper.device_id', value, 'this process trains on the CPU' if
                 here.type == 'cpu' else f'each rank trains on its {here.type} device by '
                 "LOCAL_RANK, mmengine's device_id")


def _state_dict_cfg(value: Any, out: StrategyTranslation) -> None:
    """``state_dict_cfg``: mmengine's ``'local'`` (its default) is per-rank shards."""
    hook = out.given['default_hooks.checkpoint']
    if value is None and 'state_dict_type' in hook:  # the hook's own choice stands
        out._nothing('state_dict_cfg', value, 'unset; default_hooks.checkpoint.state_dict_type='
                     f"{hook['state_dict_type']!r} is the config's")
        return
    kind = 'local' if value is None else value
    if isinstance(value, Mapping):
        option_dict(value, _STATE_DICT_CFG, 'strategy.state_dict_cfg', '')
        kind = value.get('state_dict_type', 'local')  # mmengine's default without it
    kind = _FORMATS.get(str(getattr(kind, 'name', kind)).lower().replace('_state_dict', ''))
    if kind is None:
        raise ValueError(f'strategy.state_dict_cfg: {value!r} is not translated; valid '
                         f'choices are {list(_FORMATS)} or dict(state_dict_type=...)')
    out._set('state_dict_cfg', 'checkpoint', dict(state_dict_type=kind),
             "unset: mmengine's 'local', per-rank shards" if value is None else '')
    for key in (k for k in _STATE_DICT_CFG[1:] if isinstance(value, Mapping) and k in value):
        out._nothing(f'state_dict_cfg.{key}', value[key], "how FSDP1 gathers for mmengine's "
                     'save; ' + ("mmfsdp's full format gathers to the CPU, rank 0 writes" if
                                 kind == 'full' else 'each rank writes its own shards'))


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
    _offload(zero, out)
    optim = out.given['optim_wrapper']
    own = 'type' in optim and _name(optim['type']) != 'DeepSpeedOptimWrapper'
    low = _precision(fp16, bf16, optim, own, out)
    if not own:
        out._set('optim_wrapper.type', 'optim_wrapper', dict(type=AmpOptimWrapper if low else
                                                             OptimWrapper), 'the rest kept')
    if low == 'bf16' and not own:
        out._set('bf16.enabled', 'optim_wrapper', dict(dtype='bfloat16', loss_scale=dict(
            enabled=False)), 'autocast, fp32 master weights, no loss scaling')
    elif low and not own:
        out._set('fp16.enabled', 'optim_wrapper', dict(dtype='float16'), 'autocast, fp32 master '
                 'weights')
        fixed = fp16.get('loss_scale')  # else dynamic, with DeepSpeed's defaults
        out._set('fp16.loss_scale' + ('' if fixed else '/initial_scale_power/loss_scale_window'),
                 'optim_wrapper', dict(loss_scale=float(fixed) if fixed else dict(
                     init_scale=2.0**fp16.get('initial_scale_power', 16),
                     growth_interval=fp16.get('loss_scale_window', 1000))))
    for key in (k for k in ('loss_scale', 'initial_scale_power', 'loss_scale_window')
                if own and k in fp16):
        out._nothing(f'fp16.{key}', fp16[key], "the config's optim_wrapper.loss_scale="
                     f"{optim.get('loss_scale')!r} stands")
    clip = strategy.get('gradient_clipping')
    if clip == _AUTO:
        out._nothing('gradient_clipping', clip, "the config's optim_wrapper.clip_grad="
                     f"{optim.get('clip_grad')!r} stands")
    elif isinstance(clip, bool) or not isinstance(clip, (int, float, type(None))) or \
            (clip or 0) < 0:
        _refuse('gradient_clipping', clip, "DeepSpeed takes a max norm > 0, or 0 for no "
                "clipping, or 'auto' for the config's optim_wrapper.clip_grad")
    elif clip:
        out._set('gradient_clipping', 'optim_wrapper', dict(clip_grad=dict(max_norm=clip)))
    elif clip is not None:
        out._nothing('gradient_clipping', clip, "DeepSpeed's 0: no clipping, its default")
    accumulation = strategy.get('gradient_accumulation_steps')
    if accumulation == _AUTO:
        accumulation = optim.get('accumulative_counts', 1)
        out._nothing('gradient_accumulation_steps', _AUTO, "the config's optim_wrapper."
                     f'accumulative_counts={accumulation!r} stands')
    elif accumulation is not None:
        out._set('gradient_accumulation_steps', 'optim_wrapper',
                 dict(accumulative_counts=accumulation))
    batch = (cfg.get('train_dataloader') or {}).get('batch_size')
    if strategy.get('inputs_to_half') is not None and low != 'fp16':
        _refuse('inputs_to_half', strategy['inputs_to_half'], 'it applies with fp16 only')
    if fp16.get('fp16_master_weights_and_grads'):
        _refuse('fp16.fp16_master_weights_and_grads', True, 'AMP keeps fp32 master weights')
    if strategy.get('train_micro_batch_size_per_gpu') not in (None, _AUTO, batch):
        _refuse('train_micro_batch_size_per_gpu', strategy['train_micro_batch_size_per_gpu'],
                f'train_dataloader.batch_size={batch!r} sets it; remove it')
    _train_batch_size(strategy.get('train_batch_size'), batch, accumulation or
                      optim.get('accumulative_counts', 1), cfg.get('launcher', 'none'), out)
    for key, instead in (('optimizer', 'optim_wrapper.optimizer'), ('scheduler',
                                                                     'param_scheduler')):
        if strategy.get(key) is not None:
            _refuse(key, strategy[key], f'DeepSpeed would build it in place of the config\'s; '
                    f'write {instead} instead')
    parallel = strategy.get('sequence_parallel_size')
    if parallel not in (None, 1):
        _refuse('sequence_parallel_size', parallel, 'FSDPRunner has no sequence parallelism '
                '(XTuner splits each sequence over that many ranks, another batch per rank); '
                'write 1 or remove it')
    if parallel is not None:
        out._nothing('sequence_parallel_size', parallel, 'no sequence parallelism: each rank '
                     'trains on whole sequences')
    for section, keys in dict(_DEEPSPEED, **{'': dict(_DEEPSPEED[''], **_JSON)}).items():
        for key in (k for k, why in keys.items() if why and k in sections[section]):
            out._nothing(f'{section}.{key}'.lstrip('.'), sections[section][key], keys[key])


def _precision(fp16: Mapping, bf16: Mapping, optim: Mapping, own: bool,
               out: StrategyTranslation) -> Optional[str]:
    """``'fp16'``, ``'bf16'`` or ``None`` (fp32): DeepSpeed's sections, or the config's own.

    ``enabled='auto'`` (XTuner's and HF's JSONs) takes the precision of the config's own
    ``optim_wrapper``; with ``DeepSpeedOptimWrapper``, which names none, it is refused. A
    config's own ``optim_wrapper`` that trains in another precision than an explicit
    section is refused naming both.
    """
    enabled = {k: s.get('enabled') for k, s in (('fp16', fp16), ('bf16', bf16))}
    if all(v and v != _AUTO for v in enabled.values()):
        raise ValueError('strategy.fp16 and strategy.bf16 are both enabled: enable one')
    low = next((k for k, v in enabled.items() if v and v != _AUTO), None)
    auto = [k for k, v in enabled.items() if v == _AUTO]
    if not own:
        if auto and not low:
            _refuse(f'{auto[0]}.enabled', _AUTO, "'auto' takes the precision of the config's "
                    "optim_wrapper, and DeepSpeedOptimWrapper names none: write true or false "
                    '(XTuner\'s --deepspeed writes it from the GPU)')
        return low
    kind = str(_name(optim['type'])).rpartition('.')[2]
    dtype = str(optim.get('dtype')).replace('torch.', '')
    has = None if kind != 'AmpOptimWrapper' else {'None': 'fp16', 'float16': 'fp16',
                                                   'bfloat16': 'bf16'}.get(dtype, dtype)
    if (low or not auto) and low != has:
        written = f'strategy.{low}.enabled=True' if low else 'strategy.fp16 / bf16 not enabled'
        raise ValueError(f"{written} and optim_wrapper.type={optim['type']!r}, dtype="
                         f"{optim.get('dtype')!r} train in different precisions: write "
                         "enabled='auto' to take the optim wrapper's, or make them agree")
    for key in (k for k, v in enabled.items() if v == _AUTO or k == low):
        out._nothing(f'{key}.enabled', enabled[key], f"the config's optim_wrapper.type="
                     f"{_name(optim['type'])!r}" + (f', dtype={optim.get("dtype")!r}' if has
                                                    else '') + ' stands')
    return has


#: The variable each launcher names the world size in before mmengine starts the group.
_WORLD_SIZE = dict(pytorch='WORLD_SIZE', slurm='SLURM_NTASKS', mpi='OMPI_COMM_WORLD_SIZE')


def _train_batch_size(total: Any, batch: Any, accumulation: Any, launcher: str,
                      out: StrategyTranslation) -> None:
    """DeepSpeed's ``train_batch_size``: micro batch x accumulation x world size, checked."""
    if total is None:
        return
    world = int(os.environ.get(_WORLD_SIZE.get(launcher, ''), 1))
    product = f'train_dataloader.batch_size={batch!r} x accumulation {accumulation!r} x ' \
        f'{world} rank(s)'
    if total != _AUTO and (not isinstance(batch, int) or total != batch * accumulation * world):
        _refuse('train_batch_size', total, f'DeepSpeed\'s global batch, here {product}; remove '
                'it or make them agree')
    out._nothing('train_batch_size', total, product)


def _offload(zero: Mapping, out: StrategyTranslation) -> None:
    """``zero_optimization``'s offload sections: to the CPU, all or nothing (FSDP2's offload)."""
    pinned: Dict[str, Any] = {}
    for key in (k for k in ('cpu_offload', 'offload_param', 'offload_optimizer') if k in zero):
        src, section = f'zero_optimization.{key}', zero[key]
        if not isinstance(section, Mapping):  # the legacy cpu_offload=True / False
            section = dict(device='cpu' if resolve_flag(section, f'strategy.{src}') else 'none')
        option_dict(section, ('device', 'pin_memory', 'ratio', *_OFFLOAD_TUNING.split()),
                    f'strategy.{src}', "dict(device='cpu' | 'none', ...)")
        device = section.get('device') or 'none'  # DeepSpeed's default
        if device not in ('cpu', 'none'):
            _refuse(f'{src}.device', device, "only 'cpu' is offloaded to")
        if device == 'none':
            out._nothing(src, zero[key], 'no offload, the default')
            continue
        if section.get('ratio', 1) != 1:
            _refuse(f'{src}.ratio', section['ratio'], 'FSDP2 offloads the whole optimizer state '
                    'or none of it; remove ratio (1: all) or the offload')
        out._set(src, 'model_wrapper_cfg', dict(offload=dict(cpu_offload=True)))
        if 'pin_memory' in section:
            pinned[f'{src}.pin_memory'] = resolve_flag(section['pin_memory'],
                                                       f'strategy.{src}.pin_memory')
        for name in (k for k in section if k in _OFFLOAD_TUNING.split() or k == 'ratio'):
            out._nothing(f'{src}.{name}', section[name], 'tuning of DeepSpeed\'s offload '
                         'buffers; FSDP2 keeps the offloaded state in CPU memory' if name !=
                         'ratio' else 'all of it, as FSDP2 offloads')
    if len(set(pinned.values())) > 1:
        raise ValueError(f'{" and ".join("strategy." + k for k in pinned)} differ: FSDP2 offloads '
                         'parameters, gradients and optimizer state to one kind of CPU memory; '
                         'make them equal')
    for src, pin in pinned.items():  # both the same: pinned (page-locked) CPU memory or not
        out._set(src, 'model_wrapper_cfg', dict(offload=dict(cpu_offload=True, pin_memory=pin)))
