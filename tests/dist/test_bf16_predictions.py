"""Predictions under bf16 mixed precision are the fp32 model's (issue 38).

A dense detector in miniature (:class:`BoxNet`: conv blocks sharded as units, a
neck and heads left in the root, as mmdet's FPN and heads are) returns data
samples with float boxes, scores and logits, int labels, a dict of a tuple and
metainfo. mmengine's ``runner.val()`` / ``runner.test()`` feed them to
:class:`NumpyMetric`, which reads them with ``.numpy()`` as mmdet's
``CocoMetric`` does (bf16 has no numpy type); its ``predict`` refuses bf16
boxes, as mmcv's NMS does inside mmdet's heads. One 2-process gloo group runs
FSDP2 and FSDP1 in bf16, FSDP2 with ``output_dtype='fp32'`` and the reference:
the same model (same seed, rank 0's weights) under DDP with autocast, each
trained 2 steps (or evaluated first, untrained); DDP's evaluation runs in fp32,
as mmengine's loops evaluate under AMP. Each scenario's predictions are also
compared with its own weights, gathered whole, in a plain fp32 model.
"""
import copy
import os
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mmengine.config import Config
from mmengine.dataset import pseudo_collate
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, METRICS, MODELS
from mmengine.structures import BaseDataElement, InstanceData, PixelData
from torch import nn
from torch.utils.data import Dataset

from harness import DIST_CFG, raised, run_distributed

WORLD_SIZE = 2
BLOCKS = dict(type='transformer', layer_cls=['ConvBlock'])
BF16_FSDP2 = dict(param_dtype='bf16', reduce_dtype='fp32')
BF16_FSDP1 = dict(param_dtype='bf16', reduce_dtype='fp32', buffer_dtype='fp32')
FSDP2 = dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=BLOCKS, mixed_precision=BF16_FSDP2)
FSDP1 = dict(type='mmfsdp.MMFullyShardedDataParallel', auto_wrap_policy=BLOCKS,
             mixed_precision=BF16_FSDP1)
#: name -> (model, model_wrapper_cfg). 'ddp' is the reference: fp32 weights, autocast in
#: training only. A model with its own steps is sharded as one root per child.
SCENARIOS = {
    'fsdp2': ('BoxNet', FSDP2),
    'fsdp1': ('BoxNet', FSDP1),
    'fsdp2_output_fp32': ('BoxNet', dict(FSDP2, mixed_precision=dict(BF16_FSDP2,
                                                                     output_dtype='fp32'))),
    'fsdp2_own_steps': ('OwnStepsBoxNet', FSDP2),
    'fsdp1_own_steps': ('OwnStepsBoxNet', FSDP1),
    'fsdp2_eval_first': ('BoxNet', FSDP2),
    'fsdp1_eval_first': ('BoxNet', FSDP1),
    'ddp': ('BoxNet', dict(type='mmfsdp.MMDistributedDataParallel')),
}
AMP = dict(type='mmfsdp.AmpOptimWrapper', dtype='bfloat16',
           optimizer=dict(type='SGD', lr=0.01))
#: Predictions against DDP's and against the scenario's own weights in a plain fp32 model,
#: relative to the largest value of each tensor: fp32 rounding at most (DDP's autocast and
#: FSDP's bf16 parameters train to the same weights here; sharding leaves the forward's
#: arithmetic as it is). Measured: 0.0 for both (a bf16 forward was 6.0e-3 from DDP's).
FP32_TOL = 1e-6


class ConvBlock(nn.Module):
    """A residual conv block: the unit of the wrap policy."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.conv(x))


@MODELS.register_module()
class BoxNet(BaseModel):
    """Sharded conv blocks, then a neck and heads in the root; predicts per pixel.

    ``predict`` fills each input data sample as mmdet / mmseg do:
    ``pred_instances`` (``InstanceData``: float ``bboxes`` and ``scores``, int64
    ``labels``), ``seg_logits`` (``PixelData``) and ``extra`` (a dict holding a
    tuple of a float and an int tensor). The samples it returned are kept in
    :attr:`returned` to compare the wrapper's output with.
    """

    def __init__(self, channels: int = 8, depth: int = 2, num_classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.Sequential(*(ConvBlock(channels) for _ in range(depth)))
        self.neck = nn.Conv2d(channels, channels, 1)  # in the root, after the units
        self.box_head = nn.Conv2d(channels, 5, 1)     # 4 coordinates and a score logit
        self.cls_head = nn.Conv2d(channels, num_classes, 1)
        self.returned: List[BaseDataElement] = []

    def forward(self, inputs: Any, data_samples: Any = None, mode: str = 'tensor') -> Any:
        x = self.stem(torch.stack(inputs) if isinstance(inputs, (list, tuple)) else inputs)
        x = self.neck(self.blocks(x))  # through blocks: under FSDP1's own steps, a root
        boxes, logits = self.box_head(x), self.cls_head(x)
        if mode == 'tensor':
            return boxes
        if mode == 'loss':
            return dict(loss=boxes.float().square().mean() + logits.float().square().mean())
        for box, logit, sample in zip(boxes, logits, data_samples):
            if box.dtype != torch.float32:  # mmcv's nms kernels (CPU) take fp32 only
                raise RuntimeError(f'expected scalar type Float but found {box.dtype}')
            box = box.flatten(1)
            labels = logit.flatten(1).argmax(0)
            sample.pred_instances = InstanceData(bboxes=box[:4].T * 8, scores=box[4].sigmoid(),
                                                 labels=labels)
            sample.seg_logits = PixelData(data=logit)
            sample.extra = dict(pair=(logit.mean(), labels.sum()))
        self.returned = list(data_samples)
        return data_samples


@MODELS.register_module()
class OwnStepsBoxNet(BoxNet):
    """:class:`BoxNet` with its own ``val_step`` / ``test_step``, as a TTA model has."""

    def val_step(self, data: Any) -> list:
        return self(**self.data_preprocessor(data, False), mode='predict')

    test_step = val_step


@DATASETS.register_module()
class BoxDataset(Dataset):
    """Images from a seeded generator; metainfo as mmdet's pipelines give it."""

    def __init__(self, length: int = 6) -> None:
        self.images = torch.randn(length, 3, 8, 8, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        meta = dict(img_id=i, ori_shape=(8, 8), scale_factor=np.array([2.0, 2.0]),
                    mean=torch.tensor([0.5, 0.5, 0.5]))
        return dict(inputs=self.images[i], data_samples=BaseDataElement(metainfo=meta))


@METRICS.register_module()
class NumpyMetric(BaseMetric):
    """Reads every prediction with ``.cpu().numpy()``, as mmdet's ``CocoMetric`` does."""

    def process(self, data_batch: Any, data_samples: list) -> None:
        for sample in data_samples:
            pred = sample['pred_instances']
            self.results.append(dict(
                bboxes=pred['bboxes'].cpu().numpy(), scores=pred['scores'].cpu().numpy(),
                labels=pred['labels'].cpu().numpy(),
                seg=sample['seg_logits']['data'].cpu().numpy(),
                mean=sample['extra']['pair'][0].cpu().numpy()))

    def compute_metrics(self, results: list) -> Dict[str, float]:
        return {key: float(np.mean([r[key].astype(np.float64).mean() for r in results]))
                for key in ('bboxes', 'scores', 'labels', 'seg', 'mean')}


def _config(name: str, root: str) -> Config:
    model, wrapper = SCENARIOS[name]
    loader = dict(dataset=dict(type='BoxDataset'), batch_size=2, num_workers=0,
                  sampler=dict(type='DefaultSampler', shuffle=False),
                  collate_fn=dict(type='pseudo_collate'))
    return Config(dict(
        model=dict(type=model), work_dir=os.path.join(root, name), experiment_name=name,
        launcher='pytorch', env_cfg=dict(dist_cfg=DIST_CFG), randomness=dict(seed=0),
        runner_type='mmfsdp.FSDPRunner', model_wrapper_cfg=wrapper, optim_wrapper=AMP,
        train_dataloader=loader, train_cfg=dict(by_epoch=False, max_iters=2, val_interval=3),
        val_dataloader=loader, val_cfg=dict(), val_evaluator=dict(type='NumpyMetric'),
        test_dataloader=loader, test_cfg=dict(), test_evaluator=dict(type='NumpyMetric'),
        default_hooks=dict(checkpoint=None), log_level='WARNING'))


def _leaves(sample: BaseDataElement) -> Dict[str, torch.Tensor]:
    """A predicted sample's tensors by name."""
    pred, (mean, total) = sample.pred_instances, sample.extra['pair']
    return dict(bboxes=pred.bboxes, scores=pred.scores, labels=pred.labels,
                seg=sample.seg_logits.data, mean=mean, total=total)


def _scenario(name: str, root: str) -> dict:
    """Train 2 steps (or not), ``val()``, ``test()``; one batch's steps against what the model
    returned and against its own weights, gathered, in a plain fp32 model."""
    from mmfsdp import FSDPRunner
    from mmfsdp.checkpoint.state import gather_full_state
    runner = FSDPRunner.from_cfg(_config(name, root))
    if not name.endswith('_eval_first'):
        runner.train()
    out: Dict[str, Any] = dict(val=runner.val(), test=runner.test())
    batch = pseudo_collate([runner.val_dataloader.dataset[i] for i in range(2)])
    plain = MODELS.build(dict(type=SCENARIOS[name][0])).eval()
    plain.load_state_dict(gather_full_state(runner.model, None)[0])
    out['reference'] = [{k: v.detach().clone() for k, v in _leaves(s).items()}
                        for s in plain.val_step(copy.deepcopy(batch))]
    for step in ('val_step', 'test_step'):
        predicted = getattr(runner.model, step)(batch)
        returned = runner.model.module.returned
        out[step] = dict(
            values=[{k: v.detach().clone() for k, v in _leaves(s).items()} for s in predicted],
            returned_dtypes=sorted({str(v.dtype) for s in returned for v in _leaves(s).values()}),
            # what the model returned, as it returned it: no copy, no cast
            as_returned=all(p is r for s, t in zip(predicted, returned)
                            for p, r in zip(_leaves(s).values(), _leaves(t).values())),
            types=[[type(s).__name__, type(s.pred_instances).__name__,
                    type(s.seg_logits).__name__, type(s.extra['pair']).__name__]
                   for s in predicted],
            metainfo_kept=all(s.metainfo[k] is v for s, t in zip(predicted, returned)
                              for k, v in t.metainfo.items()))
    x = torch.stack(batch['inputs'])
    runner.model.train()  # the training forward computes in bf16 again
    forward = runner.model(x, mode='tensor')  # FSDP2: the root's output takes output_dtype
    out['forward_dtype'] = str(forward.dtype)
    forward.float().sum().backward()
    return out


def _distributed(root: str) -> dict:
    return {name: _guarded(name, root) for name in SCENARIOS}


def _guarded(name: str, root: str) -> dict:
    """One scenario, or the error it raised (so each test reports its own)."""
    result: Dict[str, Any] = {}
    error = raised(lambda: result.update(_scenario(name, root)))
    return dict(result, error=error)


@pytest.fixture(scope='module')
def results(tmp_path_factory) -> List[dict]:
    return run_distributed(_distributed, WORLD_SIZE, str(tmp_path_factory.mktemp('bf16')),
                           timeout=420)


def _max_rel_diff(a: List[dict], b: List[dict]) -> float:
    """The largest difference of the float predictions, relative to each tensor's largest value."""
    return max(float((x[k] - y[k]).abs().max() / y[k].abs().max())
               for x, y in zip(a, b) for k in x if x[k].is_floating_point())


@pytest.mark.parametrize('name', [n for n in SCENARIOS if n != 'ddp'])
def test_bf16_predictions_are_the_fp32_models_and_read_by_a_numpy_metric(results, name):
    """Before c8ef00e: ``TypeError: Got unsupported ScalarType BFloat16`` in the metric, every
    rank; FSDP2 with ``output_dtype='fp32'``: the root's neck got the block unit's fp32 output.
    Before this: the forward computed in bf16 (``expected scalar type Float but found
    BFloat16`` in ``predict``, as mmcv's NMS raises in mmdet's heads)."""
    for rank, by_name in enumerate(results):
        got, ref = by_name[name], by_name['ddp']
        assert got['error'] == (None, None), f'rank {rank}: {got["error"]}'
        assert ref['error'] == (None, None), f'rank {rank}: {ref["error"]}'
        untrained = name.endswith('_eval_first')  # unlike DDP: compared with its own weights
        for step in ('val_step', 'test_step'):
            out = got[step]
            # the model computed in fp32, with fp32 parameters: its own values come back
            assert out['returned_dtypes'] == ['torch.float32', 'torch.int64']
            assert out['as_returned'] and out['metainfo_kept']
            assert _max_rel_diff(out['values'], got['reference']) < FP32_TOL
            assert all(torch.equal(v['labels'], r['labels'])
                       for v, r in zip(out['values'], got['reference']))
            assert out['types'] == [['BaseDataElement', 'InstanceData', 'PixelData',
                                     'tuple']] * 2
            assert ref[step]['returned_dtypes'] == ['torch.float32', 'torch.int64']
            if not untrained:
                assert _max_rel_diff(out['values'], ref[step]['values']) < FP32_TOL
        for split in ('val', 'test') * (not untrained):
            assert got[split] == pytest.approx(ref[split], rel=FP32_TOL, abs=1e-7)


def test_output_dtype_casts_the_model_output_only(results):
    """A conv left in the root after sharded units gets param_dtype inputs; the output is fp32."""
    for by_name in results:
        assert by_name['fsdp2_output_fp32']['forward_dtype'] == 'torch.float32'
        assert by_name['ddp']['forward_dtype'] == 'torch.float32'


@pytest.mark.parametrize('name', ['fsdp2', 'fsdp1', 'fsdp2_eval_first', 'fsdp1_eval_first'])
def test_training_computes_in_bf16_after_evaluation(results, name):
    """The full precision of ``val_step`` / ``test_step`` ends with the step: the training
    forward after it (and after an evaluation that ran the first forward, which initialises
    FSDP2 lazily) is bf16 again, and its backward runs."""
    for by_name in results:
        assert by_name[name]['error'] == (None, None)
        assert by_name[name]['forward_dtype'] == 'torch.bfloat16'
