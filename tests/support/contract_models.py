"""Models that use more of mmengine's model contract than ``toy.ToyClassifier``.

- ``FrozenBackboneClassifier``: a frozen backbone and a trainable head, both in
  the root FSDP unit (``frozen_stages``-style fine-tuning);
- ``AttentionClassifier``: an ``nn.MultiheadAttention``, whose forward reads
  ``out_proj.weight`` without calling ``out_proj``;
- ``ModuleNamedClassifier``: children called ``module`` at two depths, the
  name DDP and mmfsdp's wrappers use for their own child;
- ``ToyGAN``: its own ``train_step`` with an ``OptimWrapperDict`` (built by
  ``PerChildOptimConstructor``) and its own ``val_step`` / ``test_step``;
- ``ToyTTAModel`` over ``ToyTTADataset`` with ``ToyScales``: ``--tta``.
"""
import copy
from typing import Any, List, Optional, Sequence

import torch
import torch.nn.functional as F
from mmengine.dataset import Compose
from mmengine.model import BaseModel, BaseTTAModel, is_model_wrapper
from mmengine.optim import DefaultOptimWrapperConstructor, OptimWrapperDict, build_optim_wrapper
from mmengine.registry import DATASETS, MODELS, OPTIM_WRAPPER_CONSTRUCTORS, TRANSFORMS
from torch import nn

from toy import IN_DIM, ToyClassifier, ToyDataset


@MODELS.register_module()
class FrozenBackboneClassifier(ToyClassifier):
    """``ToyClassifier`` whose embedding and blocks do not train.

    The root unit flattens ``embed`` (frozen, 112 values), ``norm`` and
    ``head``: at two ranks the first rank's shard of it holds no trainable
    parameter, so that rank has no gradient to clip.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for module in (self.embed, self.blocks):
            module.requires_grad_(False)


@MODELS.register_module()
class AttentionClassifier(ToyClassifier):
    """``ToyClassifier`` with self-attention after its blocks (each sample one token).

    ``nn.MultiheadAttention`` holds 1088 parameters at ``dim=16``, 272 of them
    in ``out_proj``, whose weight its forward reads without calling it.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attn = nn.MultiheadAttention(self.head.in_features, 2, batch_first=True)

    def features(self, inputs: torch.Tensor) -> torch.Tensor:
        x = super().features(inputs).unsqueeze(1)
        return (x + self.attn(x, x, x, need_weights=False)[0]).squeeze(1)


@MODELS.register_module()
class BufferedClassifier(ToyClassifier):
    """``ToyClassifier`` with a buffer (a logit temperature), which DDP can broadcast."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.register_buffer('temperature', torch.ones(()))

    def forward(self, inputs: torch.Tensor, data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return outputs(self.head(self.norm(x)).float() / self.temperature, data_samples, mode)


@MODELS.register_module()
class ModuleNamedClassifier(ToyClassifier):
    """``ToyClassifier`` with a child named ``module`` and a grandchild ``neck.module``."""

    def __init__(self, dim: int = 16, **kwargs: Any) -> None:
        super().__init__(dim=dim, **kwargs)
        self.module = nn.Linear(dim, dim)
        self.neck = nn.Sequential()
        self.neck.add_module('module', nn.Linear(dim, dim))

    def forward(self, inputs: torch.Tensor, data_samples: Optional[torch.Tensor] = None,
                mode: str = 'tensor') -> Any:
        x = self.neck.module(self.module(self.embed(inputs)))
        for block in self.blocks:
            x = block(x)
        return outputs(self.head(self.norm(x)).float(), data_samples, mode)


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class WholeModelConstructor(DefaultOptimWrapperConstructor):
    """The default constructor, for a model with a child called ``module``.

    mmengine's constructor optimises ``model.module`` whenever the model has
    that attribute (meant for wrappers; one process does the same): give it a
    holder whose ``module`` is the whole model.
    """

    def __call__(self, model: nn.Module):
        holder = nn.Module()
        holder.module = model
        return super().__call__(holder)


def outputs(logits: torch.Tensor, labels: Optional[torch.Tensor], mode: str) -> Any:
    """What ``ToyClassifier.forward`` returns for ``mode``, from the logits."""
    if mode == 'loss':
        return dict(loss=F.cross_entropy(logits, labels))
    if mode == 'predict':
        nll = F.cross_entropy(logits, labels, reduction='none')
        return [dict(nll=n, correct=c) for n, c in
                zip(nll.cpu(), (logits.argmax(-1) == labels).cpu())]
    return logits


NOISE_DIM = 4


@OPTIM_WRAPPER_CONSTRUCTORS.register_module()
class PerChildOptimConstructor:
    """An ``OptimWrapperDict`` with one optim wrapper per named child (as mmagic's constructor).

    Config::

        optim_wrapper = dict(constructor='PerChildOptimConstructor',
                             generator=dict(optimizer=dict(type='Adam', lr=1e-3)),
                             discriminator=dict(optimizer=dict(type='Adam', lr=1e-3)))
    """

    def __init__(self, optim_wrapper_cfg: dict, paramwise_cfg: Optional[dict] = None) -> None:
        self.cfg = copy.deepcopy(optim_wrapper_cfg)

    def __call__(self, model: nn.Module) -> OptimWrapperDict:
        if is_model_wrapper(model):
            model = model.module
        return OptimWrapperDict(**{name: build_optim_wrapper(getattr(model, name), cfg)
                                   for name, cfg in self.cfg.items()})


@MODELS.register_module()
class ToyGAN(BaseModel):
    """A generator and a discriminator updated by the model's own ``train_step``.

    The discriminator scores ``ToyDataset`` inputs against generated ones; the
    noise is a fixed function of the batch, so any split of the global batch
    sees the same numbers. ``val_step`` is the model's own too: ``forward`` has
    no ``predict`` mode, so only it can produce predictions.
    """

    def __init__(self, data_preprocessor: Optional[dict] = None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.generator = nn.Sequential(nn.Linear(NOISE_DIM, 16), nn.GELU(), nn.Linear(16, IN_DIM))
        self.discriminator = nn.Sequential(nn.Linear(IN_DIM, 16), nn.GELU(), nn.Linear(16, 1))

    def forward(self, inputs: torch.Tensor, data_samples: Any = None, mode: str = 'tensor') -> Any:
        if mode != 'tensor':
            raise NotImplementedError(f'ToyGAN runs its own steps, not forward(mode={mode!r})')
        return self.generator(self.noise(inputs))

    @staticmethod
    def noise(inputs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(inputs[:, :NOISE_DIM].flip(-1))

    def discriminator_loss(self, real: torch.Tensor) -> torch.Tensor:
        fake = self.generator(self.noise(real)).detach()
        return (F.softplus(self.discriminator(fake)).mean()
                + F.softplus(-self.discriminator(real)).mean())

    def train_step(self, data: Any, optim_wrapper: OptimWrapperDict) -> dict:
        data = self.data_preprocessor(data, True)
        real = data['inputs']
        disc = optim_wrapper['discriminator']
        # The generator's loss also reached the discriminator in the last step.
        disc.zero_grad()
        with disc.optim_context(self.discriminator):
            loss_d = self.discriminator_loss(real)
        disc.update_params(loss_d)
        gen = optim_wrapper['generator']
        with gen.optim_context(self.generator):
            loss_g = F.softplus(-self.discriminator(self.generator(self.noise(real)))).mean()
        gen.update_params(loss_g)
        return dict(loss_d=loss_d.detach(), loss_g=loss_g.detach())

    def val_step(self, data: Any) -> list:
        data = self.data_preprocessor(data, False)
        real = data['inputs']
        score_real = self.discriminator(real).squeeze(-1)
        score_fake = self.discriminator(self.generator(self.noise(real))).squeeze(-1)
        return [dict(nll=n, correct=c) for n, c in zip(F.softplus(-score_real).cpu(),
                                                       (score_fake < 0).float().cpu())]

    def test_step(self, data: Any) -> list:
        return self.val_step(data)


@TRANSFORMS.register_module()
class ToyScales:
    """Test-time augmentation of ``ToyTTADataset`` items: the inputs at several scales."""

    def __init__(self, scales: List[float]) -> None:
        self.scales = scales

    def __call__(self, item: dict) -> dict:
        return dict(inputs=[item['inputs'] * s for s in self.scales],
                    data_samples=[item['data_samples']] * len(self.scales))


@DATASETS.register_module()
class ToyTTADataset(ToyDataset):
    """``ToyDataset`` with a ``pipeline`` (empty: the plain item), for ``tta_pipeline``."""

    def __init__(self, pipeline: Sequence[dict] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline = Compose(list(pipeline))

    def __getitem__(self, i: int) -> dict:
        return self.pipeline(super().__getitem__(i))


@MODELS.register_module()
class ToyTTAModel(BaseTTAModel):
    """Averages the negative log-likelihood over the augmentations; votes for correctness."""

    def merge_preds(self, data_samples_list: List[List[dict]]) -> List[dict]:
        return [dict(nll=sum(float(p['nll']) for p in preds) / len(preds),
                     correct=float(sum(float(p['correct']) for p in preds) * 2 > len(preds)))
                for preds in data_samples_list]


@MODELS.register_module()
class OverflowOnRank1GAN(ToyGAN):
    """``ToyGAN`` whose discriminator gradient overflows in rank 1's shard only, once.

    The first discriminator step puts an inf into one element of rank 1's local
    gradient (under FSDP1: its shard, after the reduce-scatter) and records
    whether this rank's parameters changed and the loss scale after the step.
    """

    record: Optional[dict] = None

    def train_step(self, data: Any, optim_wrapper: OptimWrapperDict) -> dict:
        if self.record is not None:
            return super().train_step(data, optim_wrapper)
        real = self.data_preprocessor(data, True)['inputs']
        disc = optim_wrapper['discriminator']
        disc.zero_grad()
        with disc.optim_context(self.discriminator):
            loss_d = self.discriminator_loss(real)
        disc.backward(loss_d)
        if torch.distributed.get_rank() == 1:
            grad = next(p.grad for p in self.discriminator.parameters()
                        if p.grad is not None and p.grad.numel())
            grad.view(-1)[0] = float('inf')
        before = [p.detach().clone() for p in self.discriminator.parameters()]
        disc.step()
        disc.zero_grad()
        self.record = dict(
            stepped=any(not torch.equal(a, p) for a, p in zip(before,
                                                             self.discriminator.parameters())),
            scale=float(disc.loss_scaler.get_scale()), scaler=type(disc.loss_scaler).__name__)
        return dict(loss_d=loss_d.detach())


@DATASETS.register_module()
class ParityShiftedDataset(ToyDataset):
    """``ToyDataset`` whose odd samples are scaled by 3 and shifted by 2.

    An unshuffled ``DefaultSampler`` on 2 ranks gives rank 0 the even samples
    and rank 1 the odd ones: the ranks' BatchNorm statistics part.
    """

    def __getitem__(self, i: int) -> dict:
        item = super().__getitem__(i)
        if i % 2:
            item['inputs'] = item['inputs'] * 3 + 2
        return item
