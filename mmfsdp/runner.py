"""``FSDPRunner``: mmengine's Runner, corrected where sharding breaks it."""
import contextlib
import dataclasses
import inspect
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from mmengine.dataset import DefaultSampler
from mmengine.dist import is_distributed, is_main_process
from mmengine.model import convert_sync_batchnorm, is_model_wrapper, revert_sync_batchnorm
from mmengine.registry import FUNCTIONS
from mmengine.runner import Runner
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader

from .agreement import check_ranks_agree, fail_together
from .amp import replace_stock_amp
from .checkpoint.durable import publish_unpublished
from .checkpoint.runner_methods import CheckpointMixin
from .checkpoint.safe_io import UNSAFE_SWITCH, safe_reads
from .checkpoint.state import (
    META_FILE,
    gather_full_state,
    load_full_model_state,
    load_full_optimizer_state,
)
from .compat import RunnerSteps, load_from, resume_requested
from .device_draws import draws_on
from .dist import (
    check_launcher,
    current_device,
    init_distributed,
    set_current_device,
    settle_at_exit,
    shutdown_at_exit,
)
from .ema import configures_ema
from .meta_init import (
    WriteTracker,
    agree_on_unwritten,
    build_on_meta,
    defer_check,
    unwritten,
)
from .optim import (
    bind_optim_wrappers,
    clip_by_global_norm,
    is_built,
    is_sharded,
    named_optim_wrappers,
    retarget_parameters,
)
from .plan import log_sharding_plan, plan_of
from .registry import RUNNERS
from .strategies import translate_strategy
from .wrappers.base import Layout, ParallelWrapper, WrapperConfig
from .wrappers.builder import Wrapping, model_wrapper_config, resolve_wrapper

__all__ = ['FSDPRunner', 'LifecycleError', 'WrapPreconditions', 'WrapState',
           'is_mmengine_default_env', 'revert_sync_bn']

#: The ``env_cfg`` that ``Runner.__init__`` takes when none is given (its
#: ``dist_cfg`` says ``backend='nccl'``, which no user wrote).
MMENGINE_DEFAULT_ENV_CFG = inspect.signature(Runner.__init__).parameters['env_cfg'].default


@RUNNERS.register_module()
class FSDPRunner(CheckpointMixin, RunnerSteps):
    """A drop-in mmengine ``Runner`` that trains sharded models to single-process numbers.

    Same constructor, config keys and loops as ``Runner``. It changes only what
    the stock Runner gets wrong under sharding: start-up on any device (gloo on
    CPU, NCCL on CUDA), the order of optimizer, weight init and wrapping,
    clipping by the norm over all shards, checkpoints every rank takes part in,
    meta init, and checks that fail on every rank before the first collective.
    Without ``model_wrapper_cfg`` (or its ``type``) a distributed run uses
    ``mmfsdp.MMDistributedDataParallel``. What each change fixes, and why: the
    documentation's page "FSDPRunner: what it changes".

    Config::

        runner_type = 'mmfsdp.FSDPRunner'
        model_wrapper_cfg = dict(
            type='mmfsdp.MMFullyShard',
            auto_wrap_policy=dict(type='transformer', layer_cls=['TransformerBlock']))
    """

    def setup_env(self, env_cfg: Dict) -> None:
        """Check the launcher, resolve the wrapper config (once), start the process group."""
        check_launcher(self.launcher)
        self._strategy = translate_strategy(self.cfg)
        try:
            wrapping = resolve_wrapper(model_wrapper_config(self.cfg),
                                       self.cfg.get('default_scope', 'mmengine'))
        except (KeyError, TypeError, ValueError) as e:
            if self._strategy.lines:
                e.add_note(self._strategy.log_block())
            raise
        wrapping.config.check_device(current_device())
        if self.cfg.get('compile') and wrapping.config.regional_compile is not None:
            raise ValueError(
                f"compile={self.cfg['compile']!r} compiles the whole train_step and "
                'model_wrapper_cfg.regional_compile compiles the named layers one by one; '
                'keep one of them (regional_compile: small graphs compiled once per layer '
                'class, the collectives outside them)')
        self._wrap_state = WrapState(wrapping, meta_init=self.distributed and wrapping.meta_init)
        if 'cpu_allocator' in env_cfg:
            raise ValueError(
                f"env_cfg.cpu_allocator={env_cfg['cpu_allocator']!r}: mmfsdp no longer sets the "
                'CPU allocator from the config; the launch does (tools/dist_train.sh preloads '
                'jemalloc or tcmalloc where installed, as torch.backends.xeon.run_cpu does). '
                'Remove the key, or set LD_PRELOAD yourself')
        if self.distributed and not is_distributed():
            # mmengine's own default names nccl: not configured, so the device picks
            dist_cfg = None if is_mmengine_default_env(env_cfg, self.cfg) else \
                env_cfg.get('dist_cfg')
            init_distributed(self.launcher, dist_cfg,
                             offload=wrapping.config.offloads_to_cpu)
            shutdown_at_exit()
        elif self.distributed:  # a group started by the caller, who destroys it
            set_current_device()  # still train on LOCAL_RANK's device
            settle_at_exit()
        super().setup_env(env_cfg)

    @staticmethod
    def build_dataloader(dataloader: Union[DataLoader, Dict], seed: Optional[int] = None,
                         diff_rank_seed: bool = False) -> DataLoader:
        """The stock dataloader, also from a config that inherits ours (``_scope_`` keys).

        mmengine passes every key of ``collate_fn`` but ``type`` to the function,
        so the ``_scope_`` it adds to inherited dicts reached ``default_collate``
        as a keyword; here the function is looked up in that scope instead.
        """
        return Runner.build_dataloader(without_collate_scope(dataloader), seed, diff_rank_seed)

    def build_val_loop(self, loop: Any) -> Any:
        """The stock loop, refused where its ranks would evaluate unequal numbers of batches."""
        return check_equal_batches(super().build_val_loop(loop), 'val_dataloader',
                                   self._wrap_state.wrapping.config)

    def build_test_loop(self, loop: Any) -> Any:
        """The stock loop, refused as :meth:`build_val_loop`."""
        return check_equal_batches(super().build_test_loop(loop), 'test_dataloader',
                                   self._wrap_state.wrapping.config)

    def build_optim_wrapper(self, optim_wrapper: Any) -> Any:
        """The stock build; mmengine's ``AmpOptimWrapper`` becomes ``mmfsdp.AmpOptimWrapper``.

        mmengine's asserts CUDA and checks only the local shard for inf/nan;
        ``tools/train.py --amp`` of OpenMMLab projects selects it. The
        replacement takes the same arguments and is logged, as the stock
        ``CheckpointHook`` becomes ``mmfsdp.CheckpointHook``.
        """
        optim_wrapper, replaced = replace_stock_amp(self._strategy.optim_wrapper_cfg(optim_wrapper))
        for key in replaced:
            self.logger.info(f"{key}: mmengine's AmpOptimWrapper replaced by "
                             'mmfsdp.AmpOptimWrapper (runs on any device; loss scaling agrees '
                             'across shards)')
        return super().build_optim_wrapper(optim_wrapper)

    def build_model(self, model: Any) -> nn.Module:
        """Build the model (on the meta device under meta init); SyncBN becomes BN on a CPU.

        torch's ``SyncBatchNorm`` runs only on an accelerator, and OpenMMLab's
        configs use it (``norm_cfg=dict(type='SyncBN')``): without one it is
        converted here, before the model is checked or walked and before any
        collective (:func:`revert_sync_bn`), and logged once. A FlexibleRunner
        ``strategy`` is logged here as translated (:mod:`mmfsdp.strategies`), once.
        What the constructor reads (mmengine's ``load_checkpoint``, ``torch.hub``'s
        ``load_state_dict_from_url`` of ``pretrained=True`` models) goes through
        the safe reader (:func:`safe_reads`), as initialisation does.
        """
        if self._strategy.lines:
            self.logger.info(self._strategy.log_block())
        with safe_reads(bool(self.cfg.get(UNSAFE_SWITCH, False))):
            if self._wrap_state.meta_init:
                built = build_on_meta(super().build_model, model)
            else:
                built = super().build_model(model)
        if current_device().type != 'cpu':
            return built
        built, converted = revert_sync_bn(built)
        if converted:
            self.logger.warning(
                f'SyncBatchNorm needs an accelerator and this host has none: '
                f"{len(converted)} modules converted to BatchNorm (mmengine's "
                f"revert_sync_batchnorm): {', '.join(converted)}."
                + (' Each rank now keeps its own running statistics; to average them across '
                   "ranks, add custom_hooks=[dict(type='SyncBuffersHook')] (before each "
                   'validation and after each training epoch)' if self.distributed else ''))
        return built

    def register_hooks(self, default_hooks: Optional[Dict] = None,
                       custom_hooks: Optional[List] = None) -> None:
        """The stock hooks; a ``strategy``'s ``state_dict_cfg`` sets the checkpoint format."""
        super().register_hooks(self._strategy.default_hooks(default_hooks), custom_hooks)

    def wrap_model(self, model_wrapper_cfg: Optional[Dict], model: nn.Module) -> nn.Module:
        """Wrap ``model`` as resolved in :meth:`setup_env`, once its weights are final.

        mmengine calls this from ``__init__``, before ``train()`` builds the
        optimizer and initialises the weights: that first call prepares
        (:meth:`_prepare`). :meth:`load_or_resume` calls it again when the
        weights are final: that call wraps (:meth:`_wrap`).
        """
        if is_model_wrapper(model) or not self.distributed:
            return super().wrap_model(model_wrapper_cfg, model)
        return self._wrap(model) if self._wrap_state.prepared else self._prepare(model)

    def _prepare(self, model: nn.Module) -> nn.Module:
        """Lay the model out (the config checked against it), agree across ranks, place it.

        The layout is the one walk into units; a rank whose check fails, or
        that built a different model or plan, makes every rank raise
        (:mod:`mmfsdp.agreement`) before the first collective that depends on
        the model. The model then goes to its device, or stays on the CPU for
        the wrapper to move unit by unit; under meta init it is wrapped at once.
        """
        state = self._wrap_state
        with fail_together('checking model_wrapper_cfg against the model'):
            state.layout = state.wrapping.layout(model)
        state.prepared = True
        check_ranks_agree(model, state.wrapping, state.layout)
        if state.meta_init:
            loads = load_from(self) is not None or resume_requested(self)
            with defer_check(loads) as pending, \
                    safe_reads(bool(self.cfg.get(UNSAFE_SWITCH, False))):
                wrapped = self._wrap(model)
            state.meta_pending, state.meta_check_after_load = pending, loads
            return wrapped
        device = current_device()
        state.staged = (state.wrapping.config.stages_on_cpu(device) and state.layout is not None
                        and state.layout.roots is None)
        return model if state.staged else model.to(device)

    def _wrap(self, model: nn.Module) -> nn.Module:
        """Build the wrapper around ``model``; point the optimizer at it."""
        state = self._wrap_state
        state.preconditions.check(self.optim_wrapper)
        with fail_together('logging the sharding plan (rank 0)'):
            self._log_sharding_plan(model)
        names = {id(p): n for n, p in model.named_parameters()}
        if self.cfg.get('sync_bn') is not None:
            if current_device().type == 'cpu':  # as a SyncBN model is reverted (build_model)
                self.logger.warning(
                    f"sync_bn={self.cfg.get('sync_bn')!r} ignored: SyncBatchNorm needs an "
                    'accelerator and this host has none, so BatchNorm is kept and each rank '
                    "keeps its own running statistics; custom_hooks=[dict(type='SyncBuffersHook')]"
                    ' averages them across ranks')
            else:
                model = convert_sync_batchnorm(model, self.cfg.get('sync_bn'))
        state.wrapped_for_evaluation = not (state.preconditions.in_train or state.meta_init)
        resumed = self._take_optimizer_state()
        self.model = state.wrapping.build(model, state.layout, current_device(),
                                          sync_module_states=state.staged)
        if is_built(self.optim_wrapper):
            retarget_parameters(self.optim_wrapper, names, self.model)
        if resumed is not None:  # resume() ran before train(): the state follows the shards
            load_full_optimizer_state(self.model, self.optim_wrapper, resumed)
        self._bind_optim_wrapper()
        return self.model

    def _take_optimizer_state(self) -> Optional[Any]:
        """The full optimizer state loaded into the unwrapped model, removed from it; or None."""
        if not is_built(self.optim_wrapper):
            return None
        named = list(named_optim_wrappers(self.optim_wrapper))
        if not any(wrapper.optimizer.state for _, wrapper in named):
            return None
        state = {name: wrapper.state_dict() for name, wrapper in named}
        for _, wrapper in named:
            wrapper.optimizer.state.clear()
        return state[None] if None in state else state

    def train(self) -> nn.Module:
        """The stock ``train()``, checking what precedes the wrap (:class:`WrapPreconditions`).

        A checkpoint still written in the background is published at the end
        (its write error raised on every rank); if training fails, rank 0
        publishes it alone if its write completed on every rank
        (:meth:`settle_checkpoint`: no collective after a failure). After
        ``val()`` / ``test()`` sharded the model with FSDP1 it is refused
        (:class:`LifecycleError`); FSDP2 trains (:meth:`init_model_weights`).
        """
        if self._wrap_state.wrapped_for_evaluation and is_sharded(self.model) and \
                not self._wrap_state.wrapping.config.shapes_kept:
            raise LifecycleError(
                f'runner.train() after runner.val() / runner.test() on one FSDPRunner: the '
                f'evaluation wrapped the model in {type(self.model).__name__}, whose parameters '
                'are flat 1-D shards from then on, and train() builds the optimizer from them '
                "(paramwise_cfg rules read each parameter's ndim) and initialises the weights "
                "whole (the model's init_weights). Train a new runner "
                '(FSDPRunner.from_cfg(cfg).train()); on this one, evaluate after train() (val() '
                "/ test(), or train_cfg.val_interval); or use model_wrapper_cfg.type="
                "'mmfsdp.MMFullyShard', which trains after an evaluation")
        if is_model_wrapper(self.model):  # val() / test() first, or meta init
            # FSDP2 keeps a root gathered after its forward: the optimizer train() builds
            # from the model must get the shards (it got the root's gathered tensors)
            for module in self.model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        with self._wrap_state.preconditions.phase('train'):
            try:
                model = super().train()
            except BaseException:
                self.settle_checkpoint()
                raise
            self.wait_for_checkpoint()
            return model

    def call_hook(self, fn_name: str, **kwargs: Any) -> None:
        """mmengine's, with the model callable from a hook as under DDP.

        A hook may call the unwrapped model's own methods outside the training
        step (XTuner's ``EvaluateChatHook`` calls ``model.generate``): a sharded
        wrapper gathers the parameters its units do not at the first such call
        (:meth:`~mmfsdp.wrappers.base.ParallelWrapper.outside_step`).
        """
        outside = (self.model.outside_step() if isinstance(self.model, ParallelWrapper)
                   else contextlib.nullcontext())
        with outside:
            super().call_hook(fn_name, **kwargs)

    def init_model_weights(self) -> None:
        """The stock initialise-and-broadcast, unless the wrapper initialises or broadcasts.

        What initialisation reads (``init_cfg`` ``Pretrained``, a backbone's own
        ``load_checkpoint``) goes through the safe reader (:func:`safe_reads`).
        A model that ``val()`` / ``test()`` sharded is initialised as a whole copy
        (:meth:`_init_whole_copy`).
        """
        with safe_reads(bool(self.cfg.get(UNSAFE_SWITCH, False))):
            if self._wrap_state.wrapped_for_evaluation and is_sharded(self.model):
                self._init_whole_copy()
            elif self._wrap_state.staged:
                model = self.model.module if is_model_wrapper(self.model) else self.model
                if callable(getattr(model, 'init_weights', None)):
                    with draws_on(current_device(), model):  # as the stock Runner's
                        model.init_weights()  # the wrapper broadcasts rank 0's, unit by unit
            elif not self._wrap_state.meta_init:
                super().init_model_weights()
        self._wrap_state.preconditions.weights_ready()

    def _init_whole_copy(self) -> None:
        """The stock initialise-and-broadcast on a whole copy of the sharded model, loaded back.

        The copy is built again from ``cfg.model`` (its construction's random
        draws forked away, so the run's random state is as a plain ``train()``
        leaves it), holds the sharded model's values (what ``val()`` saw,
        gathered), and is initialised and broadcast as the stock Runner does;
        each rank then loads its shards from it. It holds the whole model
        once more while it lives, as every rank does before a plain ``train()`` wraps.
        """
        sharded = self.model
        values, _ = gather_full_state(sharded, None)  # on rank 0 only where it offloads
        with torch.random.fork_rng(devices=[]):
            whole = self.build_model(self.cfg.get('model')).to(current_device())
        if values:
            whole.load_state_dict(values)
        self.model = whole
        try:
            super().init_model_weights()
        finally:
            self.model = sharded
        load_full_model_state(sharded, whole.state_dict(), strict=True)

    def load_or_resume(self) -> None:
        """Wrap the model, whose weights are now initialised, then load or resume.

        Under meta init with ``load_from`` / ``resume``, the tensors that no
        initialiser wrote must come from the checkpoint: checked here, on every rank.
        """
        if self.distributed and not is_model_wrapper(self.model):
            self.wrap_model(self.cfg.get('model_wrapper_cfg'), self.model)
        elif self.distributed:  # wrapped before the optim wrapper existed (meta init)
            self._wrap_state.preconditions.check(self.optim_wrapper)
            self._bind_optim_wrapper()
        if resume_requested(self) and load_from(self) is None:
            self._publish_unpublished_checkpoint()
        state = self._wrap_state
        tracker = WriteTracker()
        with tracker if state.meta_check_after_load else contextlib.nullcontext():
            super().load_or_resume()
        if state.meta_check_after_load:  # the same on every rank: a collective follows
            state.meta_check_after_load = False
            agree_on_unwritten(unwritten(self.model.module, state.meta_pending, tracker))

    def _publish_unpublished_checkpoint(self) -> None:
        """Auto-resume: first publish what a killed run of this lineage wrote completely.

        (In the background, before it could rename it into place; another run's
        leftovers in the same work dir are never published: :func:`publish_unpublished`.)
        """
        with fail_together('looking for a checkpoint written completely but not published'):
            if is_main_process():
                path = publish_unpublished(self.work_dir, META_FILE, self.checkpoint_lineage,
                                           bool(self.cfg.get(UNSAFE_SWITCH, False)))
                if path is not None:
                    self.logger.warning(f'Auto-resume: {path} was written completely in the '
                                        'background before the run stopped: published')

    def _log_sharding_plan(self, model: nn.Module) -> None:
        """Rank 0 logs the units and their bytes per rank (:mod:`mmfsdp.plan`)."""
        state = self._wrap_state
        if is_main_process() and state.wrapping.ours:
            log_sharding_plan(self.logger, plan_of(
                state.wrapping, state.layout, model, self.world_size,
                self._strategy.optim_wrapper_cfg(self.cfg.get('optim_wrapper') or {}),
                ema=configures_ema(self.cfg.get('custom_hooks'))))

    def _bind_optim_wrapper(self) -> None:
        """Route clipping to the wrapper's global norm; bind AMP. Idempotent."""
        if is_built(self.optim_wrapper):
            if is_sharded(self.model):
                clip_by_global_norm(self.optim_wrapper, self.model)
            bind_optim_wrappers(self.optim_wrapper, self.model)


def without_collate_scope(dataloader: Any) -> Any:
    """A copy of a dataloader config whose ``collate_fn`` has no ``_scope_``.

    A config inheriting ``mmfsdp::`` gets ``_scope_`` in every dict with a
    ``type``, and ``Runner.build_dataloader`` hands every key of ``collate_fn``
    but ``type`` to the function. So the function is looked up in that scope,
    as ``build_from_cfg`` would, and given as the ``type``.
    """
    if not isinstance(dataloader, Mapping):
        return dataloader
    collate = dataloader.get('collate_fn')
    if not isinstance(collate, Mapping) or '_scope_' not in collate:
        return dataloader
    collate = dict(collate)
    scope = collate.pop('_scope_')
    if isinstance(collate.get('type'), str):
        with FUNCTIONS.switch_scope_and_registry(scope) as registry:
            function = registry.get(collate['type'])
        if function is None:
            raise KeyError(f"the dataloader's collate_fn.type: {collate['type']!r} is not a "
                           f'registered function in the {scope!r} scope')
        collate['type'] = function
    return dict(dataloader, collate_fn=collate)


def check_equal_batches(loop: Any, key: str, config: WrapperConfig) -> Any:
    """``loop``, unless its ranks would run unequal numbers of batches through a collective forward.

    The ranks with fewer would leave the others waiting in an all-gather (a hang).
    mmengine's ``DefaultSampler(round_up=False)`` gives rank ``r`` of ``W`` the
    samples ``r, r + W, ...``; every rank computes every rank's count, so all
    raise together, before the loop runs.
    """
    dataloader = getattr(loop, 'dataloader', None)
    sampler = getattr(dataloader, 'sampler', None)
    if (not config.collective_forward or not isinstance(sampler, DefaultSampler)
            or sampler.round_up or not dataloader.batch_size):
        return loop
    samples, world, size = len(sampler.dataset), sampler.world_size, dataloader.batch_size
    batches = [(len(range(r, samples, world)) + (0 if dataloader.drop_last else size - 1)) // size
               for r in range(world)]
    if len(set(batches)) > 1:
        raise ValueError(
            f'{key}.sampler.round_up=False: {samples} samples on {world} ranks in batches of '
            f'{size} are {batches} batches per rank, and under {config.NAME} every evaluation '
            'batch all-gathers parameters on every rank, so the ranks with fewer would leave '
            f'the others waiting. Write {key}.sampler.round_up=True (mmengine\'s default: the '
            'last ranks repeat samples to even the count, and the evaluator drops the repeats, '
            'so metrics are over the dataset as it is), or a batch size or dataset length that '
            'gives every rank the same number of batches')
    return loop


def is_mmengine_default_env(env_cfg: Mapping, cfg: Mapping) -> bool:
    """Whether ``env_cfg`` is mmengine's default, which the user did not write.

    ``Runner(...)`` without ``env_cfg`` receives the default object of its
    signature; ``Runner.from_cfg`` gives an equal dict when the config (the
    runner's ``cfg``, then not empty) has no ``env_cfg`` key. An equal dict
    passed with no config, or from a config that has the key, is the user's.
    """
    if env_cfg is MMENGINE_DEFAULT_ENV_CFG:
        return True
    return len(cfg) > 0 and 'env_cfg' not in cfg and env_cfg == MMENGINE_DEFAULT_ENV_CFG


def revert_sync_bn(model: nn.Module) -> Tuple[nn.Module, List[str]]:
    """``model`` with every SyncBN module made BatchNorm, and the names of those converted.

    mmengine's ``revert_sync_batchnorm`` (torch's ``SyncBatchNorm`` and, where
    installed, mmcv's) keeps the parameters and buffers themselves, so a
    model built on the meta device stays there.
    """
    before = {name: type(module) for name, module in model.named_modules()}
    if not any(issubclass(cls, nn.SyncBatchNorm) or cls.__name__ == 'SyncBatchNorm'
               for cls in before.values()):
        return model, []
    model = revert_sync_batchnorm(model)
    return model, [name or '(the model)' for name, module in model.named_modules()
                   if name in before and type(module) is not before[name]]


# ---- what must have happened before train() wraps ---------------------------------------


class LifecycleError(RuntimeError):
    """The runner reached wrapping in an order that would train the wrong thing."""


class WrapPreconditions:
    """The steps of ``Runner.train()`` done so far, checked where the model is wrapped."""

    def __init__(self) -> None:
        self._phase: Optional[str] = None
        self._weights_ready = False

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Within ``name`` (``'train'``), :meth:`check` applies."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    @property
    def in_train(self) -> bool:
        """Whether ``train()`` is running."""
        return self._phase == 'train'

    def weights_ready(self) -> None:
        """Record that the weights are initialised and the same on every rank."""
        self._weights_ready = True

    def check(self, optim_wrapper: object) -> None:
        """Raise :class:`LifecycleError` if ``train()`` wraps before its preconditions hold."""
        if self._phase != 'train':
            return  # val() / test(): the weights come from load_from, no optimizer
        missing: List[str] = []
        if not is_built(optim_wrapper):
            missing.append('the optim wrapper is not built yet (build_optim_wrapper runs '
                           'first, on the unwrapped model)')
        if not self._weights_ready:
            missing.append('the weights are not initialised yet (_init_model_weights runs '
                           'first: initialise, then broadcast rank 0\'s weights)')
        if missing:
            raise LifecycleError(
                'FSDPRunner.train() reached wrapping the model (load_or_resume) too early: '
                + '; '.join(missing) + '. FSDPRunner relies on the order of mmengine\'s '
                'Runner.train() (0.10.x): build_optim_wrapper, before_run, '
                '_init_model_weights, load_or_resume; a runner subclass or an mmengine '
                'version that reorders them must keep that order')


@dataclasses.dataclass
class WrapState:
    """Where :class:`FSDPRunner` stands with wrapping: one object, set up in ``setup_env``."""

    #: The ``model_wrapper_cfg``, resolved once.
    wrapping: Wrapping
    #: The model is built on the meta device and wrapped at once.
    meta_init: bool
    #: The model cut into units by the first ``wrap_model`` (``None``: not yet, or not ours).
    layout: Optional[Layout] = None
    #: The first ``wrap_model`` ran: the next one wraps.
    prepared: bool = False
    #: The model waits on the CPU for the wrapper to move it unit by unit.
    staged: bool = False
    #: Meta init with a checkpoint to load: what no initialiser wrote, checked after loading.
    meta_pending: list = dataclasses.field(default_factory=list)
    meta_check_after_load: bool = False
    #: ``val()`` / ``test()`` wrapped the model, not ``train()`` (nor meta init).
    wrapped_for_evaluation: bool = False
    #: What must have happened before ``train()`` wraps.
    preconditions: WrapPreconditions = dataclasses.field(default_factory=WrapPreconditions)
