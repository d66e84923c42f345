"""Character-level dataset over the Python standard library's source code.

Every machine that runs mmfsdp has a Python install, so this corpus needs no
download and no data path: the text is the ``.py`` files of the running
interpreter's stdlib (``sysconfig.get_paths()['stdlib']``).

Determinism is what multi-rank training needs from it: the files are visited
in sorted order, the text is cut at a fixed number of bytes, the train/val
split is a fixed fraction, the windows are at fixed offsets, and nothing is
drawn from any RNG. The vocabulary is the 256 byte values, so it is the same
on every machine and rank whatever files (or encodings) a given Python
install has; a "character" here is a byte of the UTF-8 source.
"""
import functools
import os
import sysconfig
from typing import Any, Dict, Optional

import torch
from torch.utils.data import Dataset

from mmfsdp.registry import DATASETS

VOCAB_SIZE = 256
SPLITS = ('train', 'val')
# Third-party packages may live under the stdlib directory; they differ from
# install to install, so they are not part of the corpus.
SKIPPED_DIRS = frozenset({'site-packages', 'dist-packages', '__pycache__'})


@functools.lru_cache(maxsize=4)
def read_stdlib_bytes(max_chars: int, root: Optional[str] = None) -> bytes:
    """Concatenate stdlib ``.py`` files, in sorted walk order, up to a limit.

    Args:
        max_chars: Number of bytes to return at most; reading stops as soon
            as it is reached, so construction time does not grow with the
            size of the install.
        root: Directory to read; the running interpreter's stdlib if None.

    Returns:
        The first ``max_chars`` bytes of the files joined by newlines.
        Cached, so the train and val datasets of one process read once.

    """
    root = root or sysconfig.get_paths()['stdlib']
    chunks = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place makes os.walk visit sub-directories in order.
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIPPED_DIRS and not d.startswith('.'))
        for name in sorted(f for f in filenames if f.endswith('.py')):
            with open(os.path.join(dirpath, name), 'rb') as f:
                chunk = f.read(max_chars - total) + b'\n'
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_chars:
                return b''.join(chunks)[:max_chars]
    return b''.join(chunks)


@DATASETS.register_module()
class StdlibCharDataset(Dataset):
    """Fixed-length windows of stdlib source text for next-byte prediction.

    Item ``i`` is ``dict(inputs=x, data_samples=y)`` where ``x`` and ``y``
    are LongTensors of length ``block_size`` and ``y`` is ``x`` shifted by
    one byte (``x = w[:-1]``, ``y = w[1:]`` for a window ``w`` of
    ``block_size + 1`` bytes). mmengine's ``default_collate`` stacks them into
    (B, T) batches that the ``GPT`` model takes as they are.

    Args:
        block_size: Length of ``inputs`` and ``data_samples``.
        split: ``'train'`` (the first ``1 - val_fraction`` of the text) or
            ``'val'`` (the rest).
        max_chars: Bytes of stdlib source to use in total (both splits).
        val_fraction: Share of the text held out for ``'val'``.
        stride: Offset between consecutive windows; defaults to
            ``block_size`` (non-overlapping targets). Ignored when
            ``num_samples`` is given.
        num_samples: If given, exactly this many windows spread evenly over
            the split (useful to keep validation cheap).
        root: Directory to read instead of the running interpreter's stdlib.

    """

    vocab_size = VOCAB_SIZE

    def __init__(self,
                 block_size: int,
                 split: str = 'train',
                 max_chars: int = 2_000_000,
                 val_fraction: float = 0.1,
                 stride: Optional[int] = None,
                 num_samples: Optional[int] = None,
                 root: Optional[str] = None):
        if split not in SPLITS:
            raise ValueError(f'split must be one of {SPLITS}, got {split!r}')
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f'val_fraction must be in (0, 1), got {val_fraction}')
        if block_size < 1:
            raise ValueError(f'block_size must be positive, got {block_size}')
        text = read_stdlib_bytes(max_chars, root)
        cut = int(len(text) * (1.0 - val_fraction))
        part = text[:cut] if split == 'train' else text[cut:]
        window = block_size + 1
        if len(part) < window:
            raise ValueError(
                f'the {split!r} split has {len(part)} bytes, fewer than one '
                f'window of block_size + 1 = {window}; raise max_chars')
        self.block_size = block_size
        self.split = split
        # uint8 storage: 1 byte per character, widened to int64 per item.
        self.data = torch.frombuffer(bytearray(part), dtype=torch.uint8)
        self.starts = self._window_starts(len(part) - window, block_size,
                                          stride, num_samples)

    @staticmethod
    def _window_starts(last_start: int, block_size: int,
                       stride: Optional[int],
                       num_samples: Optional[int]) -> torch.Tensor:
        """Offsets of all windows; ``last_start`` is the largest valid one."""
        if num_samples is not None:
            if not 1 <= num_samples <= last_start + 1:
                raise ValueError(
                    f'num_samples must be in [1, {last_start + 1}] for this '
                    f'split, got {num_samples}')
            steps = torch.arange(num_samples, dtype=torch.float64)
            spacing = last_start / max(num_samples - 1, 1)
            return (steps * spacing).round().long()
        stride = block_size if stride is None else stride
        if stride < 1:
            raise ValueError(f'stride must be positive, got {stride}')
        return torch.arange(0, last_start + 1, stride)

    @property
    def metainfo(self) -> Dict[str, Any]:
        """What mmengine hands the metric and visualizer as ``dataset_meta``."""
        return dict(vocab_size=self.vocab_size, block_size=self.block_size, split=self.split)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        start = int(self.starts[index])
        window = self.data[start:start + self.block_size + 1].long()
        return dict(inputs=window[:-1], data_samples=window[1:])
