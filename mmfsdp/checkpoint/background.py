"""Asynchronous saves: staged on the main thread, written in the background, published later.

``default_hooks.checkpoint.async_save=True`` splits a save in three:

1. **stage** (main thread, training blocked): the state is gathered as for a
   synchronous save and copied, so that training may change it. A full
   checkpoint is copied on rank 0's CPU; a sharded one by :class:`ShardStager`,
   each rank's shards to its CPU;
2. **write** (a daemon thread per rank, training goes on): only files under
   the temporary name ``<token>-NAME.tmp``. A sharded write coordinates its
   ranks on a gloo group of its own (:func:`writer_group`), never on the
   groups training uses, so its collectives cannot interleave with training's;
3. **publish** (main thread, every rank: as soon as the write ended on every
   rank, polled after each training iteration; at the latest at the next save,
   the end of ``train()`` or exit): the ranks agree that every write finished
   (:func:`mmfsdp.agreement.fail_together`), then rank 0 renames the temporary
   into place and the hook repoints ``last_checkpoint`` and deletes what
   ``max_keep_ckpts`` expires.

A write that failed on any rank is raised on every rank at step 3, naming the
rank and its error; rank 0 removes the temporary. When anything else fails
first, no collective can run: rank 0 publishes alone a write that completed
(:meth:`BackgroundWrite.settle`). See ``docs/checkpoints.md``.
"""
import atexit
import collections
import concurrent.futures
import copy
import datetime
import logging
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from mmengine.logging import print_log
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from ..agreement import alone, control_group, fail_together
from ..compat import dtensor_like
from ..dist import before_shutdown
from ..options import resolve_flag
from .durable import incomplete_reason, remove_path, remove_stale_temporaries, replace_path
from .safe_io import IncompleteCheckpointError

__all__ = ['BackgroundWrite', 'ShardStager', 'publish_at_exit', 'resolve_async_save',
           'run_in_background', 'write_file_in_background', 'writer_group']


def resolve_async_save(value: Any) -> bool:
    """``async_save``: ``True`` (write in the background) or ``False`` (the default)."""
    return resolve_flag(value, 'default_hooks.checkpoint.async_save')


_WRITER_GROUPS: Dict[Tuple[Any, float], Optional[dist.ProcessGroup]] = {}


def writer_group(timeout_s: float) -> Optional[dist.ProcessGroup]:
    """The gloo group over all ranks that background sharded writes coordinate on.

    Its own group: a collective in the writer thread on a group that training
    also uses could pair with a training collective of another rank (gloo
    matches collectives by order). Created at the first sharded background
    save, which every rank makes at the same point; ``None`` without a group.
    """
    if not dist.is_initialized():
        return None
    key = (dist.group.WORLD, timeout_s)
    if key not in _WRITER_GROUPS:
        _WRITER_GROUPS[key] = dist.new_group(
            backend='gloo', timeout=datetime.timedelta(seconds=timeout_s))
    return _WRITER_GROUPS[key]


class ShardStager(AsyncStager):
    """The copies of background saves (training may change the state), reused between saves.

    One per runner. Each tensor of a save is copied to the CPU into the
    previous save's copy at the same place when that has its shape, dtype and
    strides: no allocation and no page faults, which were most of the time a
    save blocks. Sharded saves go through :meth:`stage` (DCP's stager
    protocol; FSDP1's ``ShardedTensor``, a new object per ``state_dict()``,
    gets its local shards swapped for the copies: torch 2.13's
    ``DefaultStager`` fails on it), full checkpoints through :meth:`copy`.
    Copies are reused only once the write that read them (:meth:`written_by`)
    is done, so a write never sees the next save's values.
    """

    def __init__(self) -> None:
        self._kept: Dict[str, Dict[Tuple[Any, ...], torch.Tensor]] = {}
        self._reader: Optional[concurrent.futures.Future] = None

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """A copy of a sharded save's ``state_dict`` that training cannot change, on the CPU."""
        return self.copy(state_dict, 'shards')

    def copy(self, tree: Any, kind: str = 'full') -> Any:
        """A CPU copy of ``tree`` (dicts, lists and tuples of tensors and values).

        ``kind`` names the saves whose copies are reused for each other.
        """
        if self._reader is not None and not self._reader.done():
            self._kept = {}  # that write's wait timed out: it may still read them
        previous, fresh = self._kept.get(kind, {}), {}
        self._kept[kind] = fresh
        by_id: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # aliases copied once

        def tensor(path: Tuple[Any, ...], source: torch.Tensor) -> torch.Tensor:
            if id(source) not in by_id:
                old = previous.get(path)
                fits = old is not None and (old.shape, old.dtype, old.stride()) == (
                    source.shape, source.dtype, source.stride())
                by_id[id(source)] = source, (old.copy_(source.detach()) if fits
                                             else source.detach().to('cpu', copy=True))
            fresh[path] = by_id[id(source)][1]
            return fresh[path]

        def walk(node: Any, path: Tuple[Any, ...]) -> Any:
            if type(node) in (dict, collections.OrderedDict):
                return type(node)((k, walk(v, path + (k,))) for k, v in node.items())
            if type(node) in (list, tuple):
                return type(node)(walk(v, path + (i,)) for i, v in enumerate(node))
            if isinstance(node, DTensor):
                return dtensor_like(node, tensor(path, node.to_local()))
            if callable(getattr(node, 'local_shards', None)):  # FSDP1's ShardedTensor
                for i, shard in enumerate(node.local_shards()):
                    shard.tensor = tensor(path + (i,), shard.tensor)
                return node
            if type(node) is torch.Tensor:
                return tensor(path, node)
            return copy.deepcopy(node)

        return walk(tree, ())

    def written_by(self, future: Optional[concurrent.futures.Future]) -> None:
        """The write that reads the last copy: its tensors are reused once it is done."""
        self._reader = future

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies before it returns."""

    def close(self) -> None:
        """Nothing to release: the copies are kept for the next save."""


def run_in_background(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """``fn()`` in a daemon thread; its result or its error in the returned future.

    A daemon thread, which the interpreter does not join at exit: a write stuck
    in a hung file system cannot keep alive a process that gave up on it (a
    write that ended is published at exit before: :func:`publish_at_exit`).
    """
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            future.set_exception(e)

    threading.Thread(target=run, name='mmfsdp-checkpoint', daemon=True).start()
    return future


def write_file_in_background(obj: Any, tmp: str) -> concurrent.futures.Future:
    """``torch.save`` ``obj`` (already a private copy) to ``tmp`` and ``fsync`` it, in a thread.

    Written through a Python file object, so that a full disk raises
    ``OSError`` with its ``errno`` (torch's own file writer says only "file
    write failed").
    """
    def write() -> None:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())

    return run_in_background(write)


#: The writes not yet published or settled, held here (not by their runner) for the exit.
_IN_FLIGHT: List['BackgroundWrite'] = []


class BackgroundWrite:
    """One checkpoint being written in the background, and what publishing it takes.

    Args:
        path: the checkpoint's final name.
        tmp: the temporary it is written to.
        token: the run's token (for :func:`replace_path`'s rename-aside).
        clean_tokens: the tokens whose temporaries go once it is published.
        wait_s: how long the ranks wait for each other's writes.
        future: this rank's write (``None`` on a rank that writes nothing).
            Rank 0 always writes, and its write ends after every rank's: a
            sharded one when DCP has gathered every rank's result and written
            ``.metadata``, then ``mmengine.pth``. So rank 0 alone can tell that
            the checkpoint is complete (:meth:`settle`).
        meta_file: a sharded directory's last file: set, the directory is
            checked before it is renamed into place (every tensor held whole,
            every shard file there and long enough: :func:`incomplete_reason`),
            and removed instead if it is not.

    """

    def __init__(self, path: str, tmp: str, token: str, clean_tokens: Sequence[str],
                 wait_s: float, future: Optional[concurrent.futures.Future],
                 meta_file: Optional[str] = None) -> None:
        self.path, self.tmp, self.token, self.meta_file = path, tmp, token, meta_file
        self.clean_tokens = list(clean_tokens)
        self.wait_s = wait_s
        self.future = future
        self.rank, self.world_size = ((dist.get_rank(), dist.get_world_size())
                                      if dist.is_initialized() else (0, 1))
        #: Run on every rank once the checkpoint is in place (the hook's repoint and delete).
        self.callbacks: List[Callable[[], None]] = []
        if not _IN_FLIGHT:  # atexit runs last in, first out: before the group's shutdown
            atexit.unregister(publish_at_exit)
            atexit.register(publish_at_exit)
        _IN_FLIGHT.append(self)

    def wait(self) -> None:
        """Wait for this rank's write; raise this rank's error, if its write failed.

        A sharded write that failed on another rank raises DCP's
        ``CheckpointException`` on every rank; here only the rank that failed
        raises (its own error), so that :meth:`publish`'s agreement names it on
        the others.
        """
        if self.future is None:
            return
        try:
            self.future.result(timeout=self.wait_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f'writing {self.tmp} took longer than save_timeout='
                               f'{self.wait_s} s') from None
        except CheckpointException as e:
            if self.rank in e.failures:
                raise e.failures[self.rank][0] from None
            if self.world_size == 1:  # no other rank to name it: say what DCP said
                raise RuntimeError(str(e)) from None

    def ended(self) -> bool:
        """Whether the write ended on every rank or failed on one; never waits.

        Collective: one ``all_reduce`` of two integers on the control group.
        """
        mine = self.future is None or self.future.done()
        flags = torch.tensor([int(mine), int(mine and self.future is not None
                                             and self.future.exception() is not None)])
        if self.world_size > 1:
            dist.all_reduce(flags, group=control_group())
        return flags[0].item() == self.world_size or flags[1].item() > 0

    def publish(self) -> None:
        """Agree that every rank's write finished, rename into place, run the callbacks.

        Collective. If any rank fails here (a write, or the exchange: a rank
        died), every rank raises, and rank 0 first settles the write alone
        (:meth:`settle`): complete, it is still published; failed, removed.
        """
        self._forget()
        try:
            with fail_together(f'saving checkpoint {self.path} (written in the background)',
                               self.wait_s):
                self.wait()
            with fail_together(f'publishing checkpoint {self.path}', self.wait_s):
                if self.rank == 0:
                    self._rename()
        except BaseException:
            self.settle(wait_s=0)
            raise
        for callback in self.callbacks:
            callback()

    def settle(self, wait_s: Optional[float] = None) -> None:
        """Finish the write without the other ranks: no collective (one failed, or none is left).

        Every rank waits for its own write (at most ``wait_s``, by default
        ``save_timeout``), so that it is not cut short by the process's exit.
        Then rank 0 publishes a write that succeeded (complete on every rank:
        see the class) and runs the callbacks :func:`alone`, removes one that
        failed, and leaves one still running; it logs which.
        """
        self._forget()
        if self.future is not None:
            concurrent.futures.wait([self.future], self.wait_s if wait_s is None else wait_s)
        if self.rank != 0:
            return
        succeeded = self.future.done() and self.future.exception() is None
        if succeeded and not os.path.lexists(self.tmp):
            return  # renamed into place by publish() before its exchange failed
        level = logging.ERROR
        try:
            if not self.future.done():
                message = (f'{self.path} is not published: its write was still running; '
                           f'{self.tmp} is left (the run that resumes removes it)')
            elif not succeeded:
                remove_path(self.tmp)
                error = self.future.exception()
                if isinstance(error, CheckpointException) and error.failures:
                    error = next(iter(error.failures.values()))[0]  # DCP's wrapping: the cause
                message = (f'{self.path} is not published: its write failed '
                           f'({_describe(error)}); {self.tmp} is removed')
            else:
                self._rename()
                with alone():
                    for callback in self.callbacks:
                        callback()
                message = f'{self.path} was written completely on every rank: published'
                level = logging.WARNING
        except Exception as e:  # noqa: BLE001 - the caller is already raising its own error
            message = f'{self.path} could not be published: {_describe(e)}'
        print_log(f'Training stopped while a checkpoint was written in the background. '
                  f'{message}', logger='current', level=level)

    def _rename(self) -> None:
        reason = self.meta_file and incomplete_reason(self.tmp, self.meta_file)
        if reason:  # never in place what does not hold every tensor of every rank
            remove_path(self.tmp)
            raise IncompleteCheckpointError(self.tmp, f'{reason}; it is removed, not published')
        replace_path(self.tmp, self.path, self.token)
        remove_stale_temporaries(os.path.dirname(os.path.abspath(self.path)), self.clean_tokens)

    def _forget(self) -> None:
        if self in _IN_FLIGHT:
            _IN_FLIGHT.remove(self)


def publish_at_exit() -> None:
    """Publish the writes still in flight when the interpreter exits, their runners or not.

    Run by :func:`mmfsdp.dist.shutdown_distributed` before it destroys the
    groups, and registered at a write's start, after
    :func:`mmfsdp.dist.shutdown_at_exit`, so it runs before the process group is
    destroyed at exit; without a group (the user destroyed it) each rank
    settles its write alone (:meth:`BackgroundWrite.settle`): rank 0 publishes
    it only if it holds every rank's shards, and logs what it does.
    """
    for write in list(_IN_FLIGHT):
        try:
            if write.world_size == 1 or dist.is_initialized():
                write.publish()
            else:
                write.settle()
        except Exception as e:  # noqa: BLE001 - at exit there is no caller to raise to
            print_log(f'At exit: {_describe(e)}', logger='current', level=logging.ERROR)


def _describe(error: BaseException) -> str:
    return f'{type(error).__name__}: {error}'


before_shutdown(publish_at_exit)
