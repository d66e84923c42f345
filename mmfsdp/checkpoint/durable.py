"""Writes that survive a crash or a power cut: temporary name, ``fsync``, rename, ``fsync``.

A rename is atomic, but not durable by itself: without ``fsync`` of the file
before it, a power cut can leave the final name pointing at an empty or
partial file; without ``fsync`` of the directory after it, the rename itself
can be lost. So every write here goes:

1. write ``NAME.tmp`` (a file, or a directory of shards);
2. ``fsync`` it (every file and directory in it);
3. rename it onto ``NAME``; a directory already at ``NAME`` is first renamed
   aside to ``NAME.old.tmp`` (two renames: never a moment with half a directory);
4. ``fsync`` the parent directory; only then is ``NAME.old.tmp`` removed.

A crash leaves at most ``*.tmp`` entries behind, never a partial
``NAME``; :func:`remove_stale_temporaries` deletes them at the next successful
save, and a ``NAME.old.tmp`` left without its ``NAME`` is renamed back.
"""
import os
import shutil
from typing import Any, List

import torch

__all__ = ['TMP_SUFFIX', 'fsync_path', 'remove_stale_temporaries', 'replace_path',
           'save_atomically', 'write_text_atomically']

#: The suffix of a checkpoint (file or directory) being written.
TMP_SUFFIX = '.tmp'
#: The suffix of a directory checkpoint being replaced (a ``.tmp`` too, for the clean-up).
OLD_SUFFIX = '.old' + TMP_SUFFIX


def fsync_path(path: str) -> None:
    """Flush a file, or a directory entry list, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    if not os.path.isdir(path):
        fsync_path(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def replace_path(src: str, dst: str) -> None:
    """Durably rename ``src`` (file or directory) onto ``dst``, replacing it."""
    _fsync_tree(src)
    if os.path.isdir(dst) and not os.path.islink(dst):
        aside = dst + OLD_SUFFIX
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.replace(dst, aside)
        os.replace(src, dst)
        fsync_path(_parent(dst))
        shutil.rmtree(aside)
    else:
        os.replace(src, dst)
    fsync_path(_parent(dst))


def save_atomically(obj: Any, path: str) -> None:
    """``torch.save`` to ``path.tmp``, ``fsync``, then rename onto ``path``."""
    os.makedirs(_parent(path), exist_ok=True)
    tmp = path + TMP_SUFFIX
    torch.save(obj, tmp)
    replace_path(tmp, path)


def write_text_atomically(text: str, path: str) -> None:
    """Write a small text file (a pointer such as ``last_checkpoint``) durably."""
    tmp = path + TMP_SUFFIX
    with open(tmp, 'w') as f:
        f.write(text)
    replace_path(tmp, path)


def remove_stale_temporaries(directory: str) -> List[str]:
    """Delete what crashed writes left in ``directory``; return the removed names.

    ``*.tmp`` entries are removed, except that a ``NAME.old.tmp`` whose ``NAME``
    does not exist is renamed back to ``NAME`` (a crash between the two
    renames of :func:`replace_path`). Call it only after a save has
    completed, when no write is in flight in ``directory``.
    """
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.endswith(OLD_SUFFIX):
            final = path[:-len(OLD_SUFFIX)]
            if not os.path.lexists(final):
                os.replace(path, final)
                continue
        if not name.endswith(TMP_SUFFIX):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        removed.append(name)
    if removed:
        fsync_path(directory)
    return removed
