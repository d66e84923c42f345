"""Fine-tuning as in mmengine: ``load_from`` a 5-class checkpoint into a 7-class model.

One 2-rank process group trains the 5-class source (FSDP2; a full file and a
sharded directory of the same weights), then fine-tunes a 7-class model from
each source under FSDP1, FSDP2 and DDP: from the full file, the sharded
directory, a stock single-process mmengine checkpoint, an ``http://`` URL
served by a real ``http.server`` on 127.0.0.1 in this process, and an
``open-mmlab://`` name resolved through mmengine's prefix table (its
``open_mmlab.json`` extension under ``MMENGINE_HOME``) to that server. It also
loads a sharded checkpoint whose keys carry a prefix, without and with
``revise_keys``. The stock ``Runner`` on one process fine-tunes from the same
weights for the reference. Legacy (non-zip) files are checked in this process.
"""
import functools
import http.server
import json
import logging
import os
import shutil
import threading
import warnings

import pytest
import torch
from mmengine.config import Config
from mmengine.model import BaseModel
from mmengine.registry import MODELS
from mmengine.runner import Runner

from harness import max_abs_diff, run_distributed
from mmfsdp import FSDPRunner
from mmfsdp.checkpoint import UnsafeCheckpointError
from toy import FSDP1, FSDP2, WRAPPERS, ToyClassifier, runner_config

SOURCES = ('full', 'sharded', 'stock')
GLOBAL_BATCH, SOURCE_ITERS, FINETUNE_ITERS = 8, 3, 3
SOURCE_CLASSES, TARGET_CLASSES = 5, 7
TOL = 2e-5
HEAD_MISMATCH = ('size mismatch for head.weight: copying a param with shape '
                 'torch.Size([5, 16]) from checkpoint, the shape in current model is '
                 'torch.Size([7, 16]).')


@MODELS.register_module()
class PrefixedToy(BaseModel):
    """``ToyClassifier`` under ``backbone.``: its checkpoint keys carry a prefix."""

    def __init__(self, num_classes: int = SOURCE_CLASSES) -> None:
        super().__init__()
        self.backbone = ToyClassifier(num_classes=num_classes)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        return self.backbone(inputs, data_samples, mode)


def _config(work_dir: str, wrapper, world_size: int, max_iters: int, num_classes: int,
            **extra) -> Config:
    cfg = runner_config(os.path.basename(work_dir), work_dir, wrapper=wrapper,
                        batch_size=GLOBAL_BATCH // world_size, max_iters=max_iters,
                        launcher='pytorch' if world_size > 1 else 'none')
    cfg['model'] = dict(type='ToyClassifier', num_classes=num_classes)
    cfg.update(extra)
    return Config(cfg)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _full_weights(runner) -> dict:
    from mmfsdp.checkpoint.state import gather_full_state
    model, _ = gather_full_state(runner.model, None)
    return {k: v.clone() for k, v in model.items()}


def _finetune(work_dir: str, wrapper: dict, load_from: str, **extra) -> dict:
    runner = FSDPRunner.from_cfg(_config(work_dir, wrapper, 2, FINETUNE_ITERS, TARGET_CLASSES,
                                         load_from=load_from, **extra))
    records = _Records()
    runner.logger.addHandler(records)
    runner.train()
    runner.logger.removeHandler(records)
    return dict(weights=_full_weights(runner), warnings=records.messages)


def _two_ranks(root: str, stock_source: str, url: str) -> dict:
    os.environ['TORCH_HOME'] = os.path.join(root, 'torch-home')  # the download cache
    os.environ['MMENGINE_HOME'] = os.path.join(root, 'mmengine-home')
    out = {}
    source = FSDPRunner.from_cfg(_config(
        f'{root}/source', FSDP2, 2, SOURCE_ITERS, SOURCE_CLASSES,
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=SOURCE_ITERS,
                                           by_epoch=False))))
    source.train()
    source.save_checkpoint(f'{root}/source', 'sharded.pth', state_dict_type='sharded')
    sources = dict(full=f'{root}/source/iter_{SOURCE_ITERS}.pth',
                   sharded=f'{root}/source/sharded.pth', stock=stock_source)
    for wrapper in WRAPPERS:
        for kind in SOURCES:
            out[f'{wrapper}/{kind}'] = _finetune(
                f'{root}/{wrapper}-{kind}', WRAPPERS[wrapper], sources[kind],
                allow_unsafe_checkpoints=kind == 'stock')
    if torch.distributed.get_rank() == 0:
        os.makedirs(f'{root}/zoo')
        shutil.copy(sources['full'], f'{root}/zoo/toy_source.pth')
    torch.distributed.barrier()
    out['fsdp2/http'] = _finetune(f'{root}/http', FSDP2, f'{url}/source/iter_{SOURCE_ITERS}.pth')
    out['fsdp2/open-mmlab'] = _finetune(f'{root}/open-mmlab', FSDP2, 'open-mmlab://toy_source')
    out['downloaded'] = sorted(os.listdir(os.path.join(torch.hub.get_dir(), 'checkpoints')))

    # A sharded checkpoint whose keys start with 'backbone.'.
    prefixed = FSDPRunner.from_cfg(_config(
        f'{root}/prefixed', FSDP1, 2, 1, SOURCE_CLASSES,
        model=dict(type='PrefixedToy', num_classes=SOURCE_CLASSES),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=1, by_epoch=False,
                                           state_dict_type='sharded'))))
    prefixed.train()
    out['prefixed/source'] = {k[len('backbone.'):]: v for k, v in
                              _full_weights(prefixed).items()}
    try:
        _finetune(f'{root}/prefixed-plain', FSDP1, f'{root}/prefixed/iter_1.pth')
        out['prefixed/error'] = None
    except ValueError as e:
        out['prefixed/error'] = str(e)
    runner = FSDPRunner.from_cfg(_config(f'{root}/prefixed-revised', FSDP1, 2, 1,
                                         SOURCE_CLASSES))
    runner.train()
    runner.load_checkpoint(f'{root}/prefixed/iter_1.pth', revise_keys=[(r'^backbone\.', '')])
    out['prefixed/revised'] = _full_weights(runner)
    return out if torch.distributed.get_rank() == 0 else None


def _stock_finetune(root: str, name: str, load_from: str) -> dict:
    """mmengine's stock Runner, one process, fine-tuning from ``load_from``."""
    runner = Runner.from_cfg(_config(f'{root}/{name}', None, 1, FINETUNE_ITERS, TARGET_CLASSES,
                                     load_from=load_from))
    runner.train()
    return {k: v.clone() for k, v in runner.model.state_dict().items()}


def _weights_only_copy(path: str, dst: str) -> str:
    """A stock checkpoint's ``state_dict`` in a file the stock Runner reads on torch 2.13."""
    torch.save(dict(state_dict=torch.load(path, weights_only=False)['state_dict']), dst)
    return dst


@pytest.fixture(scope='module')
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp('finetune'))


@pytest.fixture(scope='module')
def server(root):
    """A real HTTP server on 127.0.0.1 serving ``root``."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=root)
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f'http://127.0.0.1:{httpd.server_address[1]}'
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope='module')
def stock_source(root) -> str:
    """A 5-class checkpoint of mmengine's stock Runner, one process."""
    cfg = _config(f'{root}/stock-source', None, 1, SOURCE_ITERS, SOURCE_CLASSES,
                  default_hooks=dict(checkpoint=dict(type='CheckpointHook',
                                                     interval=SOURCE_ITERS, by_epoch=False)))
    Runner.from_cfg(cfg).train()
    return f'{root}/stock-source/iter_{SOURCE_ITERS}.pth'


@pytest.fixture(scope='module')
def runs(root, server, stock_source) -> dict:
    os.makedirs(f'{root}/mmengine-home', exist_ok=True)
    with open(f'{root}/mmengine-home/open_mmlab.json', 'w') as f:
        json.dump(dict(toy_source=f'{server}/zoo/toy_source.pth'), f)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        results = run_distributed(_two_ranks, 2, root, stock_source, server, timeout=600)[0]
        results['reference/full'] = _stock_finetune(
            root, 'reference-full', f'{root}/source/iter_{SOURCE_ITERS}.pth')
        results['reference/stock'] = _stock_finetune(
            root, 'reference-stock',
            _weights_only_copy(stock_source, f'{root}/stock-state-dict.pth'))
    return results


@pytest.mark.parametrize('wrapper', WRAPPERS)
@pytest.mark.parametrize('kind', SOURCES)
def test_finetune_from_other_head_warns_and_equals_stock_runner(runs, wrapper, kind):
    got = runs[f'{wrapper}/{kind}']
    mismatch = [m for m in got['warnings'] if 'do not match exactly' in m]
    assert len(mismatch) == 1, got['warnings']
    assert HEAD_MISMATCH in mismatch[0] and 'head.bias' in mismatch[0]
    reference = runs['reference/stock' if kind == 'stock' else 'reference/full']
    diff = max_abs_diff(got['weights'], reference)
    print(f'{wrapper} from {kind}: max abs diff to the stock Runner {diff:.1e}')
    assert diff <= TOL


@pytest.mark.parametrize('source', ['http', 'open-mmlab'])
def test_load_from_url_downloads_and_finetunes(runs, source):
    assert runs['downloaded'] == [f'iter_{SOURCE_ITERS}.pth', 'toy_source.pth']
    got = runs[f'fsdp2/{source}']
    assert any(HEAD_MISMATCH in m for m in got['warnings'])
    assert max_abs_diff(got['weights'], runs['reference/full']) <= TOL


def test_sharded_load_from_that_matches_no_key_names_the_keys(runs):
    message = runs['prefixed/error']
    assert message is not None
    assert "first expected key: 'embed.weight'" in message
    assert "first found: 'backbone.embed.weight'" in message
    assert 'revise_keys' in message


def test_sharded_load_with_revise_keys(runs):
    assert max_abs_diff(runs['prefixed/revised'], runs['prefixed/source']) == 0


@pytest.fixture()
def legacy_file(tmp_path, root, runs) -> str:
    path = str(tmp_path / 'legacy.pth')
    state = torch.load(f'{root}/source/iter_{SOURCE_ITERS}.pth')['state_dict']
    torch.save(dict(state_dict=state), path, _use_new_zipfile_serialization=False)
    return path


def _one_process_runner(work_dir: str, **extra):
    return FSDPRunner.from_cfg(_config(work_dir, FSDP1, 1, 1, SOURCE_CLASSES, **extra))


def test_legacy_file_is_refused_without_the_switch(tmp_path, legacy_file):
    runner = _one_process_runner(str(tmp_path / 'refused'))
    with pytest.raises(UnsafeCheckpointError) as error:
        runner.load_checkpoint(legacy_file)
    assert legacy_file in str(error.value) and 'legacy' in str(error.value)
    assert 'allow_unsafe_checkpoints = True' in str(error.value)


def test_legacy_file_loads_with_the_switch_and_a_warning(tmp_path, legacy_file):
    runner = _one_process_runner(str(tmp_path / 'opted-in'), allow_unsafe_checkpoints=True)
    with pytest.warns(UserWarning, match=legacy_file):
        runner.load_checkpoint(legacy_file)
    expected = torch.load(legacy_file, weights_only=False)['state_dict']
    assert max_abs_diff(runner.model.state_dict(), expected) == 0
