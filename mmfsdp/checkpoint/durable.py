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

A crash leaves at most temporaries behind, never a partial ``NAME``.

Temporaries carry the writing run's token (:func:`temporary_path`:
``<token>-NAME.tmp``), so a run tells its own leftovers from anything else in
the directory: :func:`remove_stale_temporaries` deletes only the temporaries
of the tokens it is given (this run's, and those of the run it resumed from),
after the next successful save, and renames back a ``<token>-NAME.old.tmp``
left without its ``NAME``. Another run's temporaries, in flight or crashed,
and a user's ``*.tmp`` files are never touched.
"""
import os
import shutil
import uuid
from typing import Any, Iterable, List

import torch

__all__ = ['TMP_SUFFIX', 'fsync_path', 'new_token', 'remove_stale_temporaries', 'replace_path',
           'save_atomically', 'temporary_path', 'write_text_atomically']

#: The suffix of a checkpoint (file or directory) being written.
TMP_SUFFIX = '.tmp'
#: The suffix of a directory checkpoint being replaced (a ``.tmp`` too, for the clean-up).
OLD_SUFFIX = '.old' + TMP_SUFFIX


def new_token() -> str:
    """A token that names one run's temporaries (``run`` and 8 random hex digits)."""
    return f'run{uuid.uuid4().hex[:8]}'


def temporary_path(path: str, token: str = '', suffix: str = TMP_SUFFIX) -> str:
    """Where ``path`` is written before its rename: ``<token>-NAME.tmp`` beside it.

    Without a token, ``NAME.tmp`` (what no clean-up ever deletes).
    """
    head, name = os.path.split(path.rstrip(os.sep))
    return os.path.join(head, f'{token}-{name}{suffix}' if token else f'{name}{suffix}')


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


def replace_path(src: str, dst: str, token: str = '') -> None:
    """Durably rename ``src`` (file or directory) onto ``dst``, replacing it.

    A directory at ``dst`` is first renamed aside to :func:`temporary_path`
    ``(dst, token, '.old.tmp')``.
    """
    _fsync_tree(src)
    if os.path.isdir(dst) and not os.path.islink(dst):
        aside = temporary_path(dst, token, OLD_SUFFIX)
        if os.path.lexists(aside):
            shutil.rmtree(aside)
        os.replace(dst, aside)
        os.replace(src, dst)
        fsync_path(_parent(dst))
        shutil.rmtree(aside)
    else:
        os.replace(src, dst)
    fsync_path(_parent(dst))


def save_atomically(obj: Any, path: str, token: str = '') -> None:
    """``torch.save`` to :func:`temporary_path`, ``fsync``, then rename onto ``path``."""
    os.makedirs(_parent(path), exist_ok=True)
    tmp = temporary_path(path, token)
    torch.save(obj, tmp)
    replace_path(tmp, path, token)


def write_text_atomically(text: str, path: str) -> None:
    """Write a small text file (a pointer such as ``last_checkpoint``) durably."""
    tmp = temporary_path(path)
    with open(tmp, 'w') as f:
        f.write(text)
    replace_path(tmp, path)


def remove_stale_temporaries(directory: str, tokens: Iterable[str]) -> List[str]:
    """Delete what crashed writes of the runs ``tokens`` left in ``directory``; return the names.

    Only ``<token>-*.tmp`` entries of these tokens are looked at: they are
    removed, except that a ``<token>-NAME.old.tmp`` whose ``NAME`` does not
    exist is renamed back to ``NAME`` (a crash between the two renames of
    :func:`replace_path`). Call it only after a save has completed, when none
    of these runs has a write in flight in ``directory``.
    """
    prefixes = tuple(f'{token}-' for token in tokens if token)
    removed: List[str] = []
    if not prefixes or not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        if not (name.startswith(prefixes) and name.endswith(TMP_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        if name.endswith(OLD_SUFFIX):
            final = os.path.join(directory, name.split('-', 1)[1][:-len(OLD_SUFFIX)])
            if not os.path.lexists(final):
                os.replace(path, final)
                continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
        removed.append(name)
    if removed:
        fsync_path(directory)
    return removed
