"""What a run reads from elsewhere loads weights-only, at 2 ranks.

``init_cfg=dict(type='Pretrained', checkpoint=<URL>)`` under ``FSDPRunner``,
eagerly and under meta init, a backbone whose own ``init_weights`` calls
mmengine's ``load_checkpoint`` (as Swin backbones do), and one whose constructor
loads the URL (mmengine's ``load_checkpoint(self, url)``, or ``torch.hub``'s
``load_state_dict_from_url`` as timm's ``pretrained=True``): a pickle served by a
local ``http.server`` is refused on both ranks and its payload (a shell command
that would create ``ran-on-rank-$RANK``) never runs; a weights-only file loads;
with ``allow_unsafe_checkpoints`` the pickle loads, with a warning. And
``load_from`` a directory that torch's own ``dcp.save`` wrote (no
``mmengine.pth``): its model entries load, whether saved under ``model.``,
``state_dict.`` or at the top level; ``resume`` from it says what it is.
One process group runs every check.
"""
import os
import warnings

import pytest
import torch
from mmengine.config import Config
from mmengine.model import BaseModel, BaseModule
from mmengine.registry import MODELS
from mmengine.runner import load_checkpoint
from torch import nn

from harness import run_distributed
from payloads import RunsCommand, serving
from toy import FSDP2, IN_DIM, ToyBlock, runner_config


class UrlBackbone(BaseModule):
    """Two ``ToyBlock``s from ``init_cfg`` Pretrained, from its own ``load_checkpoint``, or
    loaded by its constructor (``built_by``: ``'load_checkpoint'`` or ``'torch.hub'``)."""

    def __init__(self, checkpoint: str, own_loader: bool, built_by: str = '') -> None:
        super().__init__(init_cfg=None if own_loader or built_by else dict(
            type='Pretrained', checkpoint=checkpoint, prefix='backbone'))
        self.blocks = nn.ModuleList(ToyBlock(IN_DIM) for _ in range(2))
        self.checkpoint, self.own_loader = checkpoint, own_loader
        if built_by == 'load_checkpoint':  # mmengine's loader, in the constructor
            load_checkpoint(self, checkpoint, map_location='cpu', strict=False,
                            revise_keys=[(r'^backbone\.', '')])
        elif built_by == 'torch.hub':  # as timm's pretrained=True
            state = torch.hub.load_state_dict_from_url(checkpoint, map_location='cpu')
            self.load_state_dict({k[len('backbone.'):]: v for k, v in state['state_dict'].items()})

    def init_weights(self) -> None:
        if self.own_loader:  # as Swin backbones: mmengine's loader, called by the model
            load_checkpoint(self, self.checkpoint, map_location='cpu', strict=False,
                            revise_keys=[(r'^backbone\.', '')])
        else:
            super().init_weights()


@MODELS.register_module()
class UrlPretrainedToy(BaseModel):

    def __init__(self, checkpoint: str, own_loader: bool = False, built_by: str = '',
                 data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.backbone = UrlBackbone(checkpoint, own_loader, built_by)
        self.head = nn.Linear(IN_DIM, 3)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        return self.head(inputs)


# ---------------------------------------------------------------- in the process group

def _runner(name: str, root: str, model: dict, wrapper: dict, **extra):
    from mmfsdp import FSDPRunner
    cfg = runner_config(name, f'{root}/{name}', batch_size=2, wrapper=dict(wrapper), max_iters=0)
    cfg.update(model=model, **extra)
    return FSDPRunner.from_cfg(Config(cfg))


def _outcome(*args, **kwargs) -> dict:
    """The weights :func:`_runner` ``(*args, **kwargs)`` trains to (no iteration: build, wrap,
    initialise, load), or its error; and the warnings raised."""
    from mmfsdp.checkpoint.state import gather_full_state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try:
            runner = _runner(*args, **kwargs)
            runner.train()
            result = dict(weights={k: v.detach().cpu().clone() for k, v in
                                   gather_full_state(runner.model, None)[0].items()})
        except Exception as e:  # noqa: BLE001 - the checks compare the messages
            result = dict(error=f'{type(e).__name__}: {e}')
    return dict(result, warnings=[str(w.message) for w in caught])


def _two_ranks(root: str, url: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import mmfsdp  # noqa: F401  (registers the 'mmfsdp.' names)
    from mmfsdp.checkpoint.state import gather_full_state
    out = {}
    meta = dict(FSDP2, init_device='meta')
    for how, model, wrapper, extra in (
            ('eager', dict(own_loader=False), FSDP2, {}),
            ('meta init', dict(own_loader=False), meta, {}),
            ('own load_checkpoint', dict(own_loader=True), FSDP2, {}),
            ('constructor load_checkpoint', dict(built_by='load_checkpoint'), FSDP2, {}),
            ('constructor torch.hub', dict(built_by='torch.hub'), FSDP2, {}),
            ('switch, constructor torch.hub', dict(built_by='torch.hub'), FSDP2,
             dict(allow_unsafe_checkpoints=True)),
            ('switch, eager', dict(own_loader=False), FSDP2, dict(allow_unsafe_checkpoints=True)),
            ('switch, meta init', dict(own_loader=False), meta,
             dict(allow_unsafe_checkpoints=True))):
        for file in ('benign', 'evil') if 'switch' not in how else ('evil', ):
            name = f'{how}-{file}'.replace(' ', '_').replace(',', '')
            # torch.hub's download cache, one per rank (torch.hub has no download barrier)
            os.environ['TORCH_HOME'] = f"{root}/torch_home/{name}-{os.environ['RANK']}"
            out[f'{how}/{file}'] = _outcome(
                name, root, dict(type='UrlPretrainedToy', checkpoint=f'{url}/{file}.pth', **model),
                wrapper, **extra)
            dist.barrier()
            out[f'{how}/{file}']['ran on'] = sorted(
                n for n in os.listdir(root) if n.startswith('ran-on-rank-'))
            dist.barrier()
            if dist.get_rank() == 0:
                for n in out[f'{how}/{file}']['ran on']:
                    os.remove(os.path.join(root, n))
            dist.barrier()

    # load_from a directory torch's own dcp.save wrote: an FSDP2 model's DTensors under
    # 'model', a plain state dict under 'state_dict' or at the top level
    toy = dict(type='ToyClassifier')
    source = _runner('dcp-source', root, toy, FSDP2)
    source.train()
    plain = {k: v.detach().cpu().clone() for k, v in
             gather_full_state(source.model, None)[0].items()}
    out['dcp source'] = plain
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        for layout, state in (('model', dict(model=get_model_state_dict(source.model))),
                              ('state_dict', dict(state_dict=plain)), ('top level', plain)):
            path = f'{root}/dcp-{layout.replace(" ", "_")}'
            dcp.save(state, checkpoint_id=path)
            out[f'dcp {layout}'] = _outcome(f'dcp-load-{layout.replace(" ", "_")}', root, toy,
                                            FSDP2, load_from=path, randomness=dict(seed=99))
    out['dcp resume'] = _outcome('dcp-resume', root, toy, FSDP2, load_from=f'{root}/dcp-model',
                                 resume=True)
    return out


@pytest.fixture(scope='module')
def runs(tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp('untrusted')
    served = root / 'served'
    served.mkdir()
    torch.manual_seed(11)
    backbone = UrlBackbone('', own_loader=True)
    pretrained = {f'backbone.{k}': v.normal_() for k, v in backbone.state_dict().items()}
    torch.save(dict(state_dict=pretrained), served / 'benign.pth')
    # a pickle that, unpickled, runs a shell command on the rank that reads it
    payload = RunsCommand(f'touch "{root}/ran-on-rank-$RANK"')
    torch.save(dict(state_dict=pretrained, payload=payload), served / 'evil.pth')
    with serving(served) as url:
        return dict(pretrained=pretrained, ranks=run_distributed(
            _two_ranks, 2, str(root), url, timeout=400))


# ---------------------------------------------------------------- distributed checks

URL_PATHS = ('eager', 'meta init', 'own load_checkpoint', 'constructor load_checkpoint',
             'constructor torch.hub')


@pytest.mark.parametrize('how', URL_PATHS)
def test_a_url_pickle_is_refused_on_both_ranks_and_runs_nothing(runs, how):
    for rank, out in enumerate(runs['ranks']):
        got = out[f'{how}/evil']
        assert got['ran on'] == [], f'the payload ran on {got["ran on"]}'
        assert 'UnsafeCheckpointError' in got.get('error', ''), (rank, got)
        assert f'{os.system.__module__}.system' in got['error'], got['error']
        assert 'allow_unsafe_checkpoints = True' in got['error']


@pytest.mark.parametrize('how', URL_PATHS)
def test_a_weights_only_url_loads_on_both_ranks(runs, how):
    for out in runs['ranks']:
        got = out[f'{how}/benign']
        assert 'weights' in got, got.get('error')
        for key, value in runs['pretrained'].items():
            assert torch.equal(got['weights'][key], value), key


@pytest.mark.parametrize('how', ('switch, eager', 'switch, meta init',
                                 'switch, constructor torch.hub'))
def test_with_the_switch_a_url_pickle_loads_with_a_warning(runs, how):
    for out in runs['ranks']:
        got = out[f'{how}/evil']
        assert 'weights' in got, got.get('error')
        assert torch.equal(got['weights']['backbone.blocks.0.fc1.weight'],
                           runs['pretrained']['backbone.blocks.0.fc1.weight'])
        assert any('weights_only=False' in w for w in got['warnings'])
        assert got['ran on'] == ['ran-on-rank-0', 'ran-on-rank-1']  # the user trusts it


@pytest.mark.parametrize('layout', ('model', 'state_dict', 'top level'))
def test_load_from_a_dcp_save_directory_loads_its_model_entries(runs, layout):
    for out in runs['ranks']:
        got = out[f'dcp {layout}']
        assert 'weights' in got, got.get('error')
        assert got['weights'].keys() == out['dcp source'].keys()
        for key, value in out['dcp source'].items():
            assert torch.equal(got['weights'][key], value), key


def test_resume_from_a_dcp_save_directory_says_what_it_is(runs):
    for out in runs['ranks']:
        error = out['dcp resume'].get('error', '')
        assert 'DCP checkpoint without mmengine.pth' in error and 'load_from' in error, error
