"""``train_step`` / ``val_step`` / ``test_step`` shared by every mmfsdp wrapper.

They have the semantics of mmengine's ``BaseModel`` steps (data through the
module's ``data_preprocessor``, ``parse_losses``, ``optim_wrapper.update_params``)
with one difference that sharding requires: the forward always goes through
the *wrapper*, never straight to ``self.module``, so FSDP's hooks gather the
parameters for prediction as well as for training.
"""
from typing import Any, Dict, Union

import torch
from mmengine.optim import OptimWrapper

__all__ = ['DataParallelSteps']

Data = Union[dict, tuple, list]


class DataParallelSteps:
    """Mixin for a wrapper of an mmengine ``BaseModel`` held in ``self.module``."""

    def train_step(self, data: Data, optim_wrapper: OptimWrapper) -> Dict[str, torch.Tensor]:
        """Forward, backward and (on update iterations) step; returns the log variables.

        ``optim_wrapper.optim_context(self)`` enters ``self.no_sync()`` on the
        micro-steps of gradient accumulation, so gradients are reduced once per
        optimizer step.
        """
        with optim_wrapper.optim_context(self):
            data = self.module.data_preprocessor(data, training=True)
            losses = self._run_forward(data, mode='loss')
        parsed_loss, log_vars = self.module.parse_losses(losses)
        optim_wrapper.update_params(parsed_loss)
        return log_vars

    def val_step(self, data: Data) -> list:
        """Predictions for a validation batch (``mode='predict'``)."""
        data = self.module.data_preprocessor(data, training=False)
        return self._run_forward(data, mode='predict')

    def test_step(self, data: Data) -> list:
        """Predictions for a test batch (``mode='predict'``)."""
        data = self.module.data_preprocessor(data, training=False)
        return self._run_forward(data, mode='predict')

    def _run_forward(self, data: Data, mode: str) -> Any:
        if isinstance(data, dict):
            return self(**data, mode=mode)
        if isinstance(data, (list, tuple)):
            return self(*data, mode=mode)
        raise TypeError('the data_preprocessor must return a dict, list or tuple, '
                        f'got {type(data).__name__}')
