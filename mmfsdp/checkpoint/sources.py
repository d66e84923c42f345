"""Reading a checkpoint file from wherever mmengine's ``load_checkpoint`` reads one.

``load_from`` / ``resume`` / ``tools/test.py CHECKPOINT`` may name a local
file, a URL (``http(s)://``), a model-zoo name (``torchvision://``,
``open-mmlab://``, ``mmcls://``), ``pavi://`` or a storage-backend URI
(``s3://``, ``petrel://``). :func:`read_checkpoint` hands anything but a local
path to mmengine's ``CheckpointLoader``, so the prefix tables, the download
cache (``$TORCH_HOME/checkpoints``) and the backends are mmengine's own; only
the final unpickling is mmfsdp's safe :func:`~.safe_io.load_file`, so remote
files get the same ``weights_only`` check and ``allow_unsafe_checkpoints``
switch as local ones.

Example::

    load_from = 'https://download.openmmlab.com/mmclassification/v0/resnet/resnet50.pth'
"""
import contextlib
import os
from typing import Any, Callable, Iterator, List

import torch
from mmengine.runner import CheckpointLoader

from .safe_io import UnsafeCheckpointError, load_file

__all__ = ['read_checkpoint']


def read_checkpoint(filename: str, allow_unsafe: bool = False) -> Any:
    """The object saved in the checkpoint file ``filename`` (local path or any mmengine URI).

    Remote files are downloaded as mmengine downloads them (for ``http(s)://``:
    local rank 0 first, then the others from the cache; every rank must call).
    A file refused by the safe loader raises on every rank, after mmengine's
    download barrier, so no rank is left waiting in it.
    """
    if os.path.isfile(os.path.expanduser(filename)):
        return load_file(os.path.expanduser(filename), allow_unsafe)
    refused: List[UnsafeCheckpointError] = []

    def safe_load(f: Any, map_location: Any = None, **_: Any) -> Any:
        try:
            return load_file(f, allow_unsafe)
        except UnsafeCheckpointError as e:
            refused.append(e)
            return {}

    with _torch_load_replaced_by(safe_load):
        checkpoint = CheckpointLoader.load_checkpoint(filename, map_location='cpu')
    if refused:
        raise refused[0]
    return checkpoint


@contextlib.contextmanager
def _torch_load_replaced_by(load: Callable[..., Any]) -> Iterator[None]:
    # mmengine's scheme loaders (and torch.hub under them) end in a call to
    # ``torch.load`` with torch's defaults; route it to the safe loader.
    original = torch.load
    torch.load = load
    try:
        yield
    finally:
        torch.load = original
