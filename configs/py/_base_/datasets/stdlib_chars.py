# Python-style twin of configs/_base_/datasets/stdlib_chars.py: byte-level
# windows of the running interpreter's stdlib source (no download).
# batch_size is per rank; num_workers=0 leaves the cores to the training ranks.
from mmengine.dataset import DefaultSampler, default_collate

from mmfsdp.demo import Perplexity, StdlibCharDataset

dataset_type = StdlibCharDataset
block_size = 64
max_chars = 2_000_000

train_dataloader = dict(
    batch_size=16,
    num_workers=0,
    sampler=dict(type=DefaultSampler, shuffle=True),
    collate_fn=dict(type=default_collate),
    dataset=dict(
        type=dataset_type,
        split='train',
        block_size=block_size,
        max_chars=max_chars),
)
val_dataloader = dict(
    batch_size=32,
    num_workers=0,
    sampler=dict(type=DefaultSampler, shuffle=False),
    collate_fn=dict(type=default_collate),
    dataset=dict(
        type=dataset_type,
        split='val',
        block_size=block_size,
        max_chars=max_chars,
        # A fixed, evenly spread subset keeps each validation to seconds.
        num_samples=256),
)
test_dataloader = val_dataloader

val_evaluator = dict(type=Perplexity)
test_evaluator = val_evaluator
