# Python-style twin of configs/_base_/models/gpt_nano.py (kept equal by
# tests/unit/test_launch_configs.py). ~0.83M-parameter byte-level GPT: 4 blocks of
# width 128, context 64; block_size must match the dataset's.
from mmfsdp.demo import GPT

model = dict(
    type=GPT,
    vocab_size=256,
    block_size=64,
    n_layer=4,
    n_head=4,
    n_embd=128,
    dropout=0.0,
    tie_weights=True,
)
