# ~0.83M-parameter byte-level GPT: 4 blocks of width 128, context 64.
# block_size must match the dataset's block_size; vocab_size is the 256
# byte values of StdlibCharDataset.
model = dict(
    type='mmfsdp.GPT',
    vocab_size=256,
    block_size=64,
    n_layer=4,
    n_head=4,
    n_embd=128,
    dropout=0.0,
    tie_weights=True,
)
