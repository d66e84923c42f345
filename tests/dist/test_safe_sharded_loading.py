"""Sharded checkpoints load without executing anything from the directory.

torch 2.13's own DCP reader unpickles ``.metadata`` with plain ``pickle``;
mmfsdp reads it with an allow-listed unpickler on every read path (the
auto-resume completeness check, ``resume``, ``load_from``, ``python -m
mmfsdp.consolidate``, ``EMAHook``), and DCP's pickled entries with
``weights_only=True``. One process: a real sharded checkpoint of a 1-process
run with ``EMAHook``, then crafted copies of it whose unpickling creates a file.
"""
import datetime
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from typing import Callable, Dict, Optional

import pytest
import torch
import torch.distributed.checkpoint as dcp
from mmengine.hooks import Hook

from mmfsdp import FSDPRunner
from mmfsdp.checkpoint import UnsafeCheckpointError, load_file
from mmfsdp.checkpoint.safe_io import SafeFileSystemReader, read_all_shards
from mmfsdp.consolidate import consolidate
from mmfsdp.ema import EMAHook
from payloads import CreatesFile
from toy import FSDP1, checkpointing_config

#: The dist smoke (tools/test_torch.sh VERSION smoke): every compat/ entry at work.
pytestmark = pytest.mark.smoke

ITERS = 2
EMA = dict(type='EMAHook', momentum=0.2)
#: The global a crafted file's unpickling calls (``CreatesFile`` reduces to ``open``).
OPEN = f'{open.__module__}.{open.__qualname__}'


def _runner(work_dir: str, **extra) -> FSDPRunner:
    return FSDPRunner.from_cfg(checkpointing_config(
        work_dir, FSDP1, 1, global_batch=4, max_iters=ITERS, interval=ITERS,
        state_dict_type='sharded', custom_hooks=[EMA], **extra))


@pytest.fixture(scope='module')
def written(tmp_path_factory) -> str:
    """A sharded checkpoint (model, optimizer, EMA shards) the installed torch wrote."""
    work_dir = str(tmp_path_factory.mktemp('written'))
    _runner(work_dir).train()
    return os.path.join(work_dir, f'iter_{ITERS}.pth')


def _copy(checkpoint: str, root: str) -> str:
    """``checkpoint`` copied into ``root/work/``, which names it in ``last_checkpoint``."""
    path = os.path.join(root, 'work', os.path.basename(checkpoint))
    shutil.copytree(checkpoint, path)
    with open(os.path.join(root, 'work', 'last_checkpoint'), 'w') as f:
        f.write(path)
    return path


def _crafted(checkpoint: str, root: str, marker: str) -> str:
    """A copy whose ``.metadata`` is the real one plus an object that creates ``marker``."""
    path = _copy(checkpoint, root)
    metadata = SafeFileSystemReader(path).read_metadata()
    metadata.planner_data['payload'] = CreatesFile(marker)  # loads fine with plain pickle
    with open(os.path.join(path, '.metadata'), 'wb') as f:
        pickle.dump(metadata, f)
    return path


# ---- the read paths: each reads ``path`` as a user would; the refusal's message or None ----

def _auto_resume(path: str, tmp_path: str) -> None:
    _runner(os.path.dirname(path), resume=True).train()  # latest: work_dir/last_checkpoint


def _resume(path: str, tmp_path: str) -> None:
    _runner(os.path.join(tmp_path, 'resumed'), load_from=path, resume=True).train()


def _load_from(path: str, tmp_path: str) -> None:
    _runner(os.path.join(tmp_path, 'loaded'), load_from=path).train()


def _ema(path: str, tmp_path: str) -> None:
    runner = _runner(os.path.join(tmp_path, 'ema'))
    hook = next(h for h in runner.hooks if isinstance(h, EMAHook))
    hook.after_load_checkpoint_shards(runner, path, {})


def _consolidate_command(path: str, tmp_path: str) -> Optional[str]:
    done = subprocess.run([sys.executable, '-m', 'mmfsdp.consolidate', path,
                           os.path.join(tmp_path, 'full.pth')], capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr
    return done.stderr if done.returncode else None


def _refusal(read: Callable[[str, str], None]) -> Callable[[str, str], Optional[str]]:
    def run(path: str, tmp_path: str) -> Optional[str]:
        try:
            read(path, tmp_path)
        except UnsafeCheckpointError as e:
            return str(e)
        return None
    return run


READ_PATHS: Dict[str, Callable[[str, str], Optional[str]]] = {
    'auto-resume check': _refusal(_auto_resume),
    'resume': _refusal(_resume),
    'load_from': _refusal(_load_from),
    'consolidate command': _consolidate_command,
    'EMA shards': _refusal(_ema),
}


@pytest.fixture(scope='module', params=sorted(READ_PATHS))
def crafted_read(request, written, tmp_path_factory) -> dict:
    """One read path run on a crafted copy: its refusal message, and whether the file appeared."""
    root = str(tmp_path_factory.mktemp('crafted'))
    marker = os.path.join(root, 'created-by-unpickling')
    message = READ_PATHS[request.param](_crafted(written, root, marker), root)
    return dict(message=message, executed=os.path.exists(marker))


def test_crafted_metadata_executes_under_torchs_own_reader(written, tmp_path):
    # what makes the tests below meaningful: the file is dangerous for torch's reader
    marker = tmp_path / 'created-by-unpickling'
    dcp.FileSystemReader(_crafted(written, str(tmp_path), str(marker))).read_metadata()
    assert marker.exists()


def test_read_path_refuses_crafted_metadata_naming_the_global_and_the_switch(crafted_read):
    message = crafted_read['message']
    assert message is not None, 'the crafted checkpoint was read'
    assert f'{OPEN} is not a class of DCP checkpoint metadata' in message
    assert '.metadata' in message and 'allow_unsafe_checkpoints = True' in message


def test_read_path_executes_nothing_from_crafted_metadata(crafted_read):
    assert not crafted_read['executed']


@pytest.mark.parametrize('read', sorted(READ_PATHS))
def test_read_path_loads_a_checkpoint_the_installed_torch_wrote(written, tmp_path, read):
    assert READ_PATHS[read](_copy(written, str(tmp_path)), str(tmp_path)) is None


def test_opted_in_load_reads_crafted_metadata_with_pickle_and_warns(written, tmp_path):
    marker = tmp_path / 'created-by-unpickling'
    path = _crafted(written, str(tmp_path), str(marker))
    with pytest.warns(UserWarning, match='allow_unsafe_checkpoints=True'):
        _runner(str(tmp_path / 'loaded'), load_from=path, allow_unsafe_checkpoints=True).train()
    assert marker.exists()  # as torch's reader does: the user trusts this file


def _save_entries(state: dict, path: str) -> None:
    with warnings.catch_warnings():  # DCP: "assuming the intent is to save in a single process"
        warnings.simplefilter('ignore')
        dcp.save(state, checkpoint_id=path)


def test_pickled_entry_that_needs_a_global_is_refused_and_not_executed(written, tmp_path):
    # DCP stores a non-tensor value as a pickle and reads it with weights_only=False
    marker = tmp_path / 'created-by-unpickling'
    path = _copy(written, str(tmp_path))
    entries = read_all_shards(path)
    for name in os.listdir(path):
        if name.endswith(('.metadata', '.distcp')):
            os.remove(os.path.join(path, name))
    _save_entries(dict(entries, payload=CreatesFile(str(marker))), path)
    with pytest.raises(UnsafeCheckpointError, match=f"entry 'payload'.*{OPEN}"):
        consolidate(path, str(tmp_path / 'full.pth'))
    assert not marker.exists()


def test_pickled_entries_of_plain_values_load(tmp_path):
    saved = dict(weights=torch.arange(3.0), step=3, names=['a', 'b'])
    _save_entries(saved, str(tmp_path / 'plain'))
    loaded = read_all_shards(str(tmp_path / 'plain'))
    assert loaded['step'] == 3 and loaded['names'] == ['a', 'b']
    assert torch.equal(loaded['weights'], saved['weights'])


class Evil:
    """A class ``weights_only`` loading does not know."""


def test_refused_pth_names_the_rejected_global(tmp_path):
    path = str(tmp_path / 'evil.pth')
    torch.save(dict(state_dict={}, payload=Evil()), path)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_file(path)
    message = str(refused.value)
    assert f'{Evil.__module__}.{Evil.__qualname__}' in message
    assert 'Check the documentation' not in message and 'allow_unsafe_checkpoints = True' in message


def test_consolidate_command_opts_in_with_its_own_flag(written, tmp_path):
    marker = tmp_path / 'created-by-unpickling'
    path = _crafted(written, str(tmp_path), str(marker))
    refused = _consolidate_command(path, str(tmp_path))
    assert '--allow-unsafe-checkpoints' in refused and not marker.exists()
    done = subprocess.run([sys.executable, '-m', 'mmfsdp.consolidate', path,
                           str(tmp_path / 'full.pth'), '--allow-unsafe-checkpoints'],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert marker.exists()  # the user trusts this file


class _DateInMeta(Hook):
    """Stores a ``datetime.date`` in the checkpoint's meta, which only the full unpickler reads."""

    def before_save_checkpoint(self, runner, checkpoint: dict) -> None:
        checkpoint['meta']['day'] = datetime.date(2026, 12, 7)


@pytest.mark.parametrize('kind', ['full', 'sharded'])
def test_published_keys_read_the_checkpoint_with_the_switch_the_config_sets(tmp_path, kind):
    """``allow_unsafe_checkpoints = True`` lets the run publish what it lets it load."""
    cfg = checkpointing_config(str(tmp_path), FSDP1, 1, global_batch=4, max_iters=ITERS,
                               interval=ITERS, state_dict_type=kind,
                               allow_unsafe_checkpoints=True)
    cfg.default_hooks.checkpoint.published_keys = ['meta', 'state_dict']
    runner = FSDPRunner.from_cfg(cfg)
    runner.register_hook(_DateInMeta())
    with warnings.catch_warnings():  # the save-time warning names the date; loading warns too
        warnings.simplefilter('ignore')
        runner.train()
        (published,) = [n for n in os.listdir(tmp_path) if n.startswith(f'iter_{ITERS}-')]
        checkpoint = load_file(str(tmp_path / published), allow_unsafe=True)
    assert checkpoint['meta']['day'] == datetime.date(2026, 12, 7)
    assert sorted(k for k in checkpoint if k != 'mmfsdp_encoding') == ['meta', 'state_dict']
