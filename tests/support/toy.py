"""A tiny workload for the tests: a classifier made of ``ToyBlock`` layers.

``init_weights`` depends on parameter shapes, so it is observable whether it
ran on full tensors or on shards. The dataset draws from its own generator,
never from torch's global RNG. :func:`runner_config` builds the mmengine config
that every equivalence test varies, :func:`checkpointing_config` the one of
the save-and-resume tests.
"""
import copy
import itertools
import math
import os
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.evaluator import BaseMetric
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.registry import (
    DATASETS,
    HOOKS,
    METRICS,
    MODELS,
    OPTIM_WRAPPER_CONSTRUCTORS,
    OPTIM_WRAPPERS,
    OPTIMIZERS,
)
from mmengine.runner import Runner
from torch import nn
from torch.utils.data import Dataset

from harness import DIST_CFG, scalar_history

IN_DIM, NUM_CLASSES = 6, 3
#: ``model_wrapper_cfg`` of the toy model under each wrapper; the sharded ones
#: make every ``ToyBlock`` a unit. Tests derive variants with ``dict(FSDP1, ...)``.
FSDP1 = dict(type='mmfsdp.MMFullyShardedDataParallel',
             auto_wrap_policy=dict(type='transformer', layer_cls=['ToyBlock']))
FSDP2 = dict(type='mmfsdp.MMFullyShard',
             auto_wrap_policy=dict(type='transformer', layer_cls=['ToyBlock']))
DDP = dict(type='mmfsdp.MMDistributedDataParallel')
WRAPPERS = {'fsdp1': FSDP1, 'fsdp2': FSDP2, 'ddp': DDP}


class ToyBlock(nn.Module):
    """Pre-norm residual MLP block: the unit of the ``transformer`` policy."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


@MODELS.register_module()
class ToyClassifier(BaseModel):

    def __init__(self, dim: int = 16, depth: int = 3, data_preprocessor=None,
                 num_classes: int = NUM_CLASSES) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.embed = nn.Linear(IN_DIM, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                fan_out, fan_in = module.weight.shape
                nn.init.normal_(module.weight, std=1 / math.sqrt(fan_in))
                nn.init.constant_(module.bias, 0.01 * fan_out)

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, inputs: torch.Tensor, data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        logits = self.head(self.norm(self.features(inputs))).float()
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, data_samples))
        if mode == 'predict':
            nll = F.cross_entropy(logits, data_samples, reduction='none')
            return [dict(nll=n, correct=c) for n, c in
                    zip(nll.cpu(), (logits.argmax(-1) == data_samples).cpu())]
        return logits


def meta_toy() -> 'ToyClassifier':
    """A ``ToyClassifier`` on the meta device: shapes for the plan, no storage."""
    with torch.device('meta'):
        return ToyClassifier()


@DATASETS.register_module()
class ToyDataset(Dataset):
    """Inputs from a seeded generator; labels from a fixed random projection."""

    def __init__(self, length: int = 64, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(length, IN_DIM, generator=gen)
        self.labels = (self.inputs @ torch.randn(IN_DIM, NUM_CLASSES, generator=gen)).argmax(-1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return dict(inputs=self.inputs[i], data_samples=self.labels[i])


@METRICS.register_module()
class ToyMetric(BaseMetric):
    """Accuracy and mean negative log-likelihood over the whole split."""

    def process(self, data_batch: Any, data_samples: list) -> None:
        self.results.extend((float(s['nll']), float(s['correct'])) for s in data_samples)

    def compute_metrics(self, results: list) -> Dict[str, float]:
        return dict(nll=sum(r[0] for r in results) / len(results),
                    accuracy=sum(r[1] for r in results) / len(results))


@HOOKS.register_module()
class NormRecorder(Hook):
    """Keeps this rank's buffers at each validation (before or after a hook that syncs them)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.records: list = []

    def before_val_epoch(self, runner) -> None:
        from mmfsdp.names import unwrapped_named_buffers
        self.records.append({name: b.detach().clone()
                             for name, b in unwrapped_named_buffers(runner.model)})


@HOOKS.register_module()
class ValStepHook(Hook):
    """Calls ``runner.model.val_step`` on the training batch after iteration ``at`` (1-based).

    A hook that evaluates inside the training loop, mid-epoch and possibly mid-accumulation, as
    visualisation hooks of OpenMMLab codebases do; the batch is the one just trained on, so no
    loader is iterated (and no random number drawn).
    """

    def __init__(self, at: int) -> None:
        self.at = at

    def after_train_iter(self, runner, batch_idx: int, data_batch: Any = None,
                         outputs: Any = None) -> None:
        if runner.iter + 1 == self.at:
            with torch.no_grad():
                runner.model.val_step(data_batch)


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class DecayByDepth:
    """Layer-wise lr decay (the role of mmpretrain's ``LearningRateDecayOptimWrapperConstructor``).

    Block ``i`` of ``n`` gets ``lr * rate**(n - i)``; the rest keeps ``lr``.
    """

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: dict) -> None:
        self.cfg, self.rate = dict(optim_wrapper_cfg), paramwise_cfg['layer_decay_rate']

    def __call__(self, model: nn.Module) -> Any:
        optimizer_cfg = dict(self.cfg.pop('optimizer'))
        depth, lr = len(model.blocks), optimizer_cfg['lr']
        groups = [dict(params=[p], lr=lr * self.rate**(
            depth - int(n.split('.')[1]) if n.startswith('blocks.') else 0))
            for n, p in model.named_parameters()]
        optimizer = OPTIMIZERS.build(dict(optimizer_cfg, params=groups))
        return OPTIM_WRAPPERS.build(self.cfg, default_args=dict(optimizer=optimizer))


#: Numbers the runner configs of a process. mmengine's Runner takes its MessageHub, logger and
#: visualizer by ``experiment_name + '_' + timestamp`` (to the second) and reuses an existing
#: instance of that name, runtime info included: two runs of one name built within a second
#: shared the first one's ``best_ckpt``, and the second deleted the first one's best checkpoint.
_RUNS = itertools.count()


def runner_config(name: str, work_dir: str, *, batch_size: int, max_iters: int = 6,
                  launcher: str = 'pytorch', wrapper: Optional[dict] = None,
                  optim_wrapper: Optional[dict] = None, val: bool = False,
                  dataset_length: int = 48) -> dict:
    """The mmengine config of one tiny training run (a new dict, and a new experiment name, on
    every call)."""
    loader = dict(dataset=dict(type='ToyDataset', length=dataset_length),
                  sampler=dict(type='DefaultSampler', shuffle=True, seed=0),
                  collate_fn=dict(type='default_collate'), batch_size=batch_size, num_workers=0)
    cfg = dict(
        model=dict(type='ToyClassifier'),
        work_dir=work_dir,
        experiment_name=f'{name}-{next(_RUNS)}',
        launcher=launcher,
        env_cfg=dict(dist_cfg=DIST_CFG),
        randomness=dict(seed=1),
        train_dataloader=loader,
        train_cfg=dict(by_epoch=False, max_iters=max_iters, val_interval=max_iters + 1),
        optim_wrapper=optim_wrapper or dict(optimizer=dict(type='AdamW', lr=1e-2)),
        default_hooks=dict(checkpoint=None, logger=dict(type='LoggerHook', interval=1)),
        log_level='WARNING',
    )
    if val:
        val_loader = copy.deepcopy(loader)
        val_loader['dataset'].update(seed=1, length=22)  # 22: padded to 24 on 2 ranks
        val_loader['sampler'] = dict(type='DefaultSampler', shuffle=False)
        cfg.update(val_dataloader=val_loader, val_cfg=dict(), val_evaluator=dict(type='ToyMetric'),
                   test_dataloader=copy.deepcopy(val_loader), test_cfg=dict(),
                   test_evaluator=dict(type='ToyMetric'))
    if wrapper is not None:
        cfg.update(runner_type='mmfsdp.FSDPRunner', model_wrapper_cfg=wrapper)
    return copy.deepcopy(cfg)


def train_one_process(cfg: dict, val: bool = False) -> Dict[str, Any]:
    """Train ``cfg`` with mmengine's stock Runner in this process: the reference of a check.

    Returns the runner, its final weights (cloned), the gradient norms it
    logged, and with ``val`` what ``runner.val()`` and ``runner.test()`` return
    (``None`` without).
    """
    runner = Runner.from_cfg(Config(cfg))
    runner.train()
    return dict(runner=runner,
                state={k: v.detach().clone() for k, v in runner.model.state_dict().items()},
                grad_norm=scalar_history(runner, 'train/grad_norm'),
                val=runner.val() if val else None, test=runner.test() if val else None)


def checkpointing_config(work_dir: str, wrapper: dict, world_size: int,
                         optim_wrapper: Optional[dict] = None, *, global_batch: int,
                         max_iters: int, interval: int, state_dict_type: str = 'full',
                         resume_from: Optional[str] = None, **extra: Any) -> Config:
    """One toy run on ``world_size`` ranks that saves every ``interval`` iterations.

    The global batch stays ``global_batch`` whatever the world size, so runs at
    different sizes see the same samples per step; one rank runs without a
    launcher. ``resume_from`` resumes (``load_from`` + ``resume=True``);
    ``extra`` is set on the config last.
    """
    cfg = runner_config(os.path.basename(work_dir), work_dir, wrapper=wrapper,
                        batch_size=global_batch // world_size, max_iters=max_iters,
                        launcher='pytorch' if world_size > 1 else 'none',
                        optim_wrapper=optim_wrapper)
    cfg['default_hooks']['checkpoint'] = dict(type='CheckpointHook', interval=interval,
                                              by_epoch=False, state_dict_type=state_dict_type)
    if resume_from is not None:
        cfg.update(load_from=resume_from, resume=True)
    cfg.update(extra)
    return Config(cfg)


def saved_activation_bytes(wrapper_cls: type, checkpoint: bool) -> int:
    """Bytes autograd keeps for backward in one forward of a wrapped toy model.

    ``wrapper_cls`` is an mmfsdp sharded wrapper; with ``checkpoint`` its
    ``ToyBlock`` layers are activation-checkpointed. Needs a process group.
    """
    torch.manual_seed(0)
    cfg = dict(auto_wrap_policy=dict(type='transformer', layer_cls=['ToyBlock']))
    if checkpoint:
        cfg['activation_checkpointing'] = dict(layer_cls=['ToyBlock'])
    model = wrapper_cls.from_options(ToyClassifier(dim=64, depth=4), **cfg)
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(torch.randn(32, IN_DIM), torch.zeros(32, dtype=torch.long),
                     mode='loss')['loss']
    loss.backward()
    return sum(saved)
