# Python-style twin of configs/_base_/schedules/iter_based.py: AdamW, linear
# warm-up, then cosine decay, counted in iterations.
from mmengine.optim import CosineAnnealingLR, LinearLR, OptimWrapper
from torch.optim import AdamW

optim_wrapper = dict(
    type=OptimWrapper,
    optimizer=dict(type=AdamW, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1),
)

param_scheduler = [
    dict(type=LinearLR, start_factor=0.1, by_epoch=False, begin=0, end=20),
    dict(
        type=CosineAnnealingLR,
        eta_min=2e-4,
        by_epoch=False,
        begin=20,
        end=300),
]

train_cfg = dict(by_epoch=False, max_iters=300, val_interval=100)
val_cfg = dict()
test_cfg = dict()
