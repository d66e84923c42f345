"""Publishing a checkpoint: one file with only the ``published_keys``, named by its hash.

``CheckpointHook(published_keys=['meta', 'state_dict'])`` publishes the last
and the best checkpoints after training, as mmengine does; here the source may
also be a sharded directory, which is consolidated first (in one process, no
collective). The result ``iter_N-<sha256[:8]>.pth`` is a full checkpoint that
loads with ``torch.load(weights_only=True)`` and with mmengine's
``load_checkpoint``; its name carries the first 8 hex digits of the file's
SHA-256, the convention ``torch.hub`` checks with ``check_hash=True``.

Example::

    default_hooks = dict(checkpoint=dict(type='CheckpointHook', interval=1000,
                                         state_dict_type='sharded',
                                         published_keys=['meta', 'state_dict']))
"""
import hashlib
import os
import tempfile
from typing import Any, Dict, Sequence

from .durable import replace_path, save_atomically
from .encoding import ENCODING_KEY
from .safe_io import load_file
from .sharded import is_sharded_checkpoint

__all__ = ['publish']


def publish(path: str, published_keys: Sequence[str]) -> Dict[str, Any]:
    """Write ``<path without .pth>-<sha8>.pth`` with the ``published_keys`` of ``path``.

    Returns ``dict(path=..., removed=[keys left out])``.
    """
    from ..consolidate import consolidate  # consolidate imports this package
    if is_sharded_checkpoint(path):
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(path))) as tmp:
            checkpoint = consolidate(path, os.path.join(tmp, 'full.pth'))
    else:
        checkpoint = load_file(path)
    record = checkpoint.pop(ENCODING_KEY, {})
    removed = [k for k in checkpoint if k not in published_keys]
    checkpoint = {k: v for k, v in checkpoint.items() if k in published_keys}
    record = {k: v for k, v in record.items() if k in published_keys}
    if record:  # how the published entries' numpy values come back (:mod:`.encoding`)
        checkpoint[ENCODING_KEY] = record
    base = os.path.splitext(path.rstrip(os.sep))[0]
    tmp = f'{base}-publishing.pth'
    save_atomically(checkpoint, tmp)
    digest = hashlib.sha256()
    with open(tmp, 'rb') as f:
        for block in iter(lambda: f.read(1 << 20), b''):
            digest.update(block)
    final = f'{base}-{digest.hexdigest()[:8]}.pth'
    replace_path(tmp, final)
    return dict(path=final, removed=removed)
