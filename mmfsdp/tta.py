"""``tools/test.py --tta``: mmengine's test-time augmentation flow, as a config change.

As OpenMMLab's ``tools/test.py``: the model becomes ``tta_model`` (a
``BaseTTAModel``) around the configured model, and the test dataset's pipeline
becomes ``tta_pipeline``. ``BaseTTAModel`` runs its own ``test_step``, so the
wrappers shard its child ``module`` as a root of its own
(as any model with its own steps); its checkpoint is the plain model's.

Config::

    tta_model = dict(type='AverageClsScoreTTA')
    tta_pipeline = [dict(type='LoadImageFromFile'),
                    dict(type='TestTimeAug', transforms=[[...], [...]])]
"""
import copy

from mmengine.config import Config, ConfigDict

__all__ = ['tta_config']


def tta_config(cfg: Config) -> Config:
    """A copy of ``cfg`` that tests ``tta_model`` around ``model`` on ``tta_pipeline``."""
    missing = [key for key in ('tta_model', 'tta_pipeline') if key not in cfg]
    if missing:
        raise KeyError(f'--tta needs {" and ".join(missing)} in the config: tta_model=dict('
                       "type='<a BaseTTAModel>'), tta_pipeline=[...] (the test pipeline with "
                       'TestTimeAug)')
    cfg = copy.deepcopy(cfg)
    cfg.model = ConfigDict(**cfg.tta_model, module=cfg.model)
    dataset = cfg.test_dataloader
    while 'dataset' in dataset:
        dataset = dataset['dataset']
    dataset.pipeline = cfg.tta_pipeline
    return cfg
