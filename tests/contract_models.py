"""Models that use more of mmengine's model contract than ``toy.ToyClassifier``.

- ``FrozenBackboneClassifier``: a frozen backbone and a trainable head, both in
  the root FSDP unit (``frozen_stages``-style fine-tuning);
- ``ModuleNamedClassifier``: children called ``module`` at two depths, the
  name DDP and mmfsdp's wrappers use for their own child.
"""
from typing import Any, Optional

import torch
import torch.nn.functional as F
from mmengine.optim import DefaultOptimWrapperConstructor
from mmengine.registry import MODELS, OPTIM_WRAPPER_CONSTRUCTORS
from torch import nn

from toy import ToyClassifier


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
