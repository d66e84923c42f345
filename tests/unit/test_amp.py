"""``mmfsdp.AmpOptimWrapper`` built without a process: on a CPU-only machine, with every dtype
mmengine's takes, refusing an unknown loss scale.
"""
import pytest
import torch

import contract_models  # noqa: F401  (registers the models)
from toy import ToyClassifier


def test_amp_wrapper_builds_on_a_cpu_only_machine():
    from mmfsdp import AmpOptimWrapper
    amp = AmpOptimWrapper(optimizer=torch.optim.SGD(ToyClassifier().parameters(), lr=0.1),
                          dtype='bf16')
    assert amp.cast_dtype is torch.bfloat16
    assert isinstance(amp.loss_scaler, torch.amp.GradScaler)


def test_amp_wrapper_rejects_an_unknown_loss_scale():
    from mmfsdp import AmpOptimWrapper
    with pytest.raises(TypeError, match="optim_wrapper.loss_scale: expected 'dynamic'"):
        AmpOptimWrapper(optimizer=torch.optim.SGD(ToyClassifier().parameters(), lr=0.1),
                        loss_scale='auto')


@pytest.mark.parametrize('name', ['float16', 'bfloat16', 'float32', 'float64'])
def test_amp_wrapper_accepts_every_dtype_mmengines_does(name):
    """mmengine's AmpOptimWrapper takes these names and autocasts to ``getattr(torch, name)``."""
    from mmengine.optim import AmpOptimWrapper as StockAmpOptimWrapper

    from mmfsdp import AmpOptimWrapper
    assert name in StockAmpOptimWrapper.valid_dtypes
    model = torch.nn.Linear(6, 3).double()
    amp = AmpOptimWrapper(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), dtype=name)
    assert amp.cast_dtype is getattr(torch, name)
    x = torch.randn(4, 6, dtype=torch.float64)
    with amp.optim_context(model):
        got = model(x)
    # as the stock wrapper's autocast(dtype=...): torch's autocast with that dtype (on the CPU,
    # float32 and float64 leave it disabled: the model computes in its own dtype)
    with torch.autocast('cpu', dtype=getattr(torch, name)):
        expected = model(x)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
