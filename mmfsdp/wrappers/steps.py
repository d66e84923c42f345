"""``train_step`` / ``val_step`` / ``test_step`` shared by every mmfsdp wrapper.

They have the semantics of mmengine's ``BaseModel`` steps (data through the
module's ``data_preprocessor``, ``parse_losses``, ``optim_wrapper.update_params``)
with one difference that sharding requires: the forward always goes through
the *wrapper*, never straight to ``self.module``, so FSDP's hooks gather the
parameters for prediction as well as for training.

A model that defines a step itself (a GAN's ``train_step`` with an
``OptimWrapperDict``, ``BaseTTAModel.test_step``) gets that step called. It
runs its sub-modules itself, past the wrapper's forward, so the wrappers make
those sub-modules gather and reduce on their own (:mod:`mmfsdp.wrappers.separate`).
"""
from typing import Any, Dict, List, Union

import torch
from mmengine.model import BaseModel
from mmengine.optim import OptimWrapper
from torch import nn

__all__ = ['DataParallelSteps', 'STEPS', 'own_steps']

#: The step methods mmengine's loops call on a model (wrapper).
STEPS = ('train_step', 'val_step', 'test_step')

Data = Union[dict, tuple, list]


def own_steps(module: nn.Module) -> List[str]:
    """The steps ``module``'s class defines itself instead of inheriting ``BaseModel``'s."""
    return [step for step in STEPS
            if getattr(type(module), step, None) not in (None, getattr(BaseModel, step))]


class DataParallelSteps:
    """Mixin for a wrapper of an mmengine ``BaseModel`` held in ``self.module``."""

    def train_step(self, data: Data, optim_wrapper: OptimWrapper) -> Dict[str, torch.Tensor]:
        """Forward, backward and (on update iterations) step; returns the log variables.

        ``optim_wrapper.optim_context(self)`` enters ``self.no_sync()`` on the
        micro-steps of gradient accumulation, so gradients are reduced once per
        optimizer step. A model's own ``train_step`` is called instead.
        """
        if 'train_step' in own_steps(self.module):
            return self.module.train_step(data, optim_wrapper)
        with optim_wrapper.optim_context(self):
            data = self.module.data_preprocessor(data, training=True)
            losses = self._run_forward(data, mode='loss')
        parsed_loss, log_vars = self.module.parse_losses(losses)
        optim_wrapper.update_params(parsed_loss)
        return log_vars

    def val_step(self, data: Data) -> list:
        """Predictions for a validation batch (``mode='predict'``), or the model's own."""
        if 'val_step' in own_steps(self.module):
            return self.module.val_step(data)
        data = self.module.data_preprocessor(data, training=False)
        return self._run_forward(data, mode='predict')

    def test_step(self, data: Data) -> list:
        """Predictions for a test batch (``mode='predict'``), or the model's own."""
        if 'test_step' in own_steps(self.module):
            return self.module.test_step(data)
        data = self.module.data_preprocessor(data, training=False)
        return self._run_forward(data, mode='predict')

    def _run_forward(self, data: Data, mode: str) -> Any:
        if isinstance(data, dict):
            return self(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self(*data, mode=mode)
        raise TypeError('the data_preprocessor must return a dict, list or tuple, '
                        f'got {type(data).__name__}')
