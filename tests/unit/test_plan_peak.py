"""The plan's step peak: activations traced with fake tensors, the parts of a peak, budgets."""
import functools

import pytest
import torch

from mmfsdp.plan import heap_threshold, plan_for, step_peak, trace_for
from mmfsdp.plan.allocator import GLIBC_MAX_MMAP_THRESHOLD
from mmfsdp.plan.batch import config_batch, shape_batch
from mmfsdp.plan.fit import parse_bytes
from mmfsdp.wrappers import MMDistributedDataParallel, MMFullyShard, MMFullyShardedDataParallel
from vision import IMAGES, PREPROCESSOR, Block, ConvBNClassifier

BLOCKS = dict(type='transformer', layer_cls=['TransformerBlock'])
FSDP = dict(type='mmfsdp.MMFullyShardedDataParallel', auto_wrap_policy=BLOCKS)
AC = dict(activation_checkpointing=dict(layer_cls=['TransformerBlock']))
DATA = dict(batch_size=2, collate_fn=dict(type='default_collate'),
            dataset=dict(type='mmfsdp.StdlibCharDataset', block_size=64, max_chars=20_000))


def _gpt():
    from mmfsdp.demo import GPT
    with torch.device('meta'):
        return GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


@functools.cache
def _trace(checkpointing=False, bf16=False, batch_size=2):
    wrapper = dict(FSDP, **AC) if checkpointing else dict(FSDP)
    if bf16:
        wrapper['mixed_precision'] = dict(param_dtype='bf16')
    batch, _ = config_batch(DATA, 'mmengine', batch_size)
    return trace_for(MMFullyShardedDataParallel, wrapper, _gpt(), batch)


def test_activations_grow_with_the_batch_and_shrink_with_checkpointing():
    two, eight = _trace(), _trace(batch_size=8)
    assert 3.8 < eight.activation_bytes / two.activation_bytes <= 4.0
    assert set(two.by_unit) == {'', 'blocks.0', 'blocks.1', 'blocks.2', 'blocks.3'}
    assert sum(two.by_unit.values()) == two.activation_bytes
    checkpointed = _trace(checkpointing=True, batch_size=8)
    assert checkpointed.checkpointed == ('TransformerBlock', )
    # only each block's input is kept: (B, T, C) floats per block
    assert checkpointed.by_unit['blocks.0'] == 8 * 64 * 128 * 4
    assert checkpointed.activation_bytes < eight.activation_bytes / 4
    # backward recomputes one block at a time: its activations come back as a transient
    assert checkpointed.transient_bytes > eight.by_unit['blocks.0']


def test_mixed_precision_activations_take_the_compute_dtype():
    full = _trace(batch_size=8)
    half = _trace(bf16=True, batch_size=8)
    assert half.compute_dtype == torch.bfloat16
    # LayerNorm keeps its statistics in float32: a few KiB over half
    assert 0.5 <= half.by_unit['blocks.1'] / full.by_unit['blocks.1'] < 0.51


def test_step_peak_adds_the_parts_and_the_model_is_left_untouched():
    model = _gpt()
    before = [(n, p.device, p.dtype) for n, p in model.named_parameters()]
    batch, _ = config_batch(DATA, 'mmengine')
    trace_for(MMFullyShardedDataParallel, dict(FSDP, **AC), model, batch)
    trace = _trace()
    plan = plan_for(MMFullyShardedDataParallel, FSDP, model, 2, dict(type='AdamW'))
    step = step_peak(plan, trace, 2)
    grads = sum(u.grad_bytes for u in plan.units)
    assert step.freed_grad_bytes == grads
    assert step.total_bytes == (plan.model_state_bytes_per_rank - grads
                                + plan.gathered_in_flight_bytes
                                + max(trace.activation_bytes, grads) + trace.transient_bytes)
    assert [(n, p.device, p.dtype) for n, p in model.named_parameters()] == before
    # DDP's gradient buckets stay allocated: gradients and activations add up
    ddp = plan_for(MMDistributedDataParallel, dict(type='mmfsdp.MMDistributedDataParallel'),
                   model, 2, dict(type='AdamW'))
    assert step_peak(ddp, trace, 2).total_bytes == (ddp.model_state_bytes_per_rank
                                                    + trace.peak_bytes)
    assert not any(hasattr(m, '_checkpoint_wrapped_module') for m in model.modules())


def test_cpu_heap_activations_stay_resident_beside_the_gradients():
    trace = _trace(batch_size=8)
    sizes = trace.activation_sizes
    assert sum(sizes) == trace.activation_bytes and list(sizes) == sorted(sizes, reverse=True)
    # (B, T, C) floats per block output: 8 x 64 x 128 x 4 = 256 KiB, the MLP's hidden 1 MiB
    below = trace.activation_bytes_below(2**20)
    assert 0 < below < trace.activation_bytes
    assert below == sum(n for n in sizes if n < 2**20)
    plan = plan_for(MMFullyShardedDataParallel, FSDP, _gpt(), 2, dict(type='AdamW'))
    device = step_peak(plan, trace, 8)
    cpu = step_peak(plan, trace, 8, heap_threshold=2**20)
    grads = cpu.freed_grad_bytes
    assert device.heap_activation_bytes == 0 and cpu.heap_activation_bytes == below
    # on the CPU, gloo stages a unit per collective: the larger of that and the traced rise
    assert device.staging_bytes == 0 and device.transient_bytes == trace.transient_bytes
    assert cpu.staging_bytes == plan.largest_unit.gathered_bytes > 0
    assert cpu.transient_bytes == max(trace.transient_bytes, cpu.staging_bytes)
    # heap blocks make no room for the gradients: they count beside max(rest, gradients)
    assert cpu.total_bytes == (plan.model_state_bytes_per_rank - grads
                               + plan.gathered_in_flight_bytes + below
                               + max(trace.activation_bytes - below, grads)
                               + cpu.transient_bytes)
    # every activation on the heap: gradients and activations add up, as DDP's do
    everything = step_peak(plan, trace, 8, heap_threshold=2**40)
    assert everything.total_bytes == (plan.model_state_bytes_per_rank
                                      + plan.gathered_in_flight_bytes
                                      + trace.activation_bytes + cpu.transient_bytes)
    # one rank: nothing to all-gather or reduce-scatter, nothing staged
    alone = plan_for(MMFullyShardedDataParallel, FSDP, _gpt(), 1, dict(type='AdamW'))
    assert step_peak(alone, trace, 8, heap_threshold=2**20).staging_bytes == 0
    # DDP: gradients and activations add up anyway, and an all-reduce stages nothing
    ddp = plan_for(MMDistributedDataParallel, dict(type='mmfsdp.MMDistributedDataParallel'),
                   _gpt(), 2, dict(type='AdamW'))
    assert (step_peak(ddp, trace, 8, heap_threshold=2**20).total_bytes
            == step_peak(ddp, trace, 8).total_bytes)


def test_accumulated_gradients_add_to_the_next_micro_steps_activations():
    trace = _trace(batch_size=8)
    model = _gpt()
    for mode, grads_sharded in (('sharded', True), ('unsharded', False)):
        wrapper = dict(FSDP, accumulation=mode)
        one = plan_for(MMFullyShardedDataParallel, wrapper, model, 2, dict(type='AdamW'))
        four = plan_for(MMFullyShardedDataParallel, wrapper, model, 2, dict(type='AdamW'),
                        accumulative_counts=4)
        assert step_peak(one, trace, 8).freed_grad_bytes > 0
        step = step_peak(four, trace, 8, heap_threshold=2**20)
        assert step.freed_grad_bytes == 0  # alive from micro-step 1's backward to the update
        assert step.total_bytes == (four.model_state_bytes_per_rank
                                    + four.gathered_in_flight_bytes + trace.activation_bytes
                                    + step.transient_bytes)
        shard = sum(u.grad_bytes for u in one.units)
        assert sum(u.grad_bytes for u in four.units) == (shard if grads_sharded else
                                                         sum(u.numel for u in four.units) * 4)


def test_fit_memory_plans_with_the_configured_accumulation():
    from mmfsdp.plan.fit import fit
    batch, size = config_batch(DATA, 'mmengine', 8)
    found = {k: {(c.label, c.checkpointing): c.step for c in fit(
        _gpt(), FSDP, 'mmengine', batch, size, [2], ['TransformerBlock'],
        accumulative_counts=k)} for k in (1, 4)}
    assert found[1].keys() == found[4].keys()
    for key, step in found[4].items():
        assert step.plan.accumulative_counts == 4 and step.freed_grad_bytes == 0
        assert step.total_bytes >= found[1][key].total_bytes


def test_heap_threshold_follows_the_device_and_cpu_allocator():
    assert heap_threshold('cuda', 'jemalloc') is None
    assert heap_threshold('cpu', 'glibc', env={}) == GLIBC_MAX_MMAP_THRESHOLD == 32 * 2**20
    assert heap_threshold('cpu', 'glibc', env={'MALLOC_MMAP_THRESHOLD_': '1048576'}) == 2**20
    assert heap_threshold('cpu', 'jemalloc', env={'MALLOC_MMAP_THRESHOLD_': '1'}) == 16 * 2**10
    assert heap_threshold('cpu', 'tcmalloc') == 256 * 2**10
    with pytest.raises(ValueError, match="--cpu-allocator: 'cache' is not one of glibc, "
                                         'jemalloc, tcmalloc'):
        heap_threshold('cpu', 'cache')


def test_an_input_shape_traces_without_a_dataset():
    batch, size = shape_batch([3, 64], torch.int64, batch_size=6)
    trace = trace_for(MMFullyShardedDataParallel, FSDP, _gpt(), batch)
    assert size == 6 and trace.activation_bytes > 0


def test_sizes_read_as_budgets():
    assert parse_bytes('24GiB') == 24 * 2**30 and parse_bytes('80 GB') == 80 * 10**9
    with pytest.raises(ValueError, match='--fit-memory.*24GiB'):
        parse_bytes('24 gigs')


FSDP2_BF16 = dict(type='mmfsdp.MMFullyShard', mixed_precision=dict(param_dtype='bf16'))


def _bn_model():
    with torch.device('meta'):
        return ConvBNClassifier(data_preprocessor=PREPROCESSOR)


def test_a_batchnorm_model_traces_with_its_data_preprocessor():
    batch, _ = config_batch(IMAGES, 'mmengine')
    trace = trace_for(MMFullyShard, dict(type='mmfsdp.MMFullyShard'), _bn_model(), batch)
    # each conv's input and output, 4 x 8 x 32 x 32 floats, are kept for backward
    assert trace.activation_bytes > 4 * 4 * 8 * 32 * 32 * 4
    assert trace.peak_bytes >= trace.activation_bytes


def test_bf16_trace_keeps_batchnorm_in_fp32_as_training_does():
    model = _bn_model()
    seen = {}

    def record(module, args, output, name):  # hooks travel with the traced copy
        seen[name] = (args[0].dtype, next(module.parameters()).dtype, output.dtype)

    for name in ('stem.0', 'stem.1', 'head'):
        model.get_submodule(name).register_forward_hook(
            functools.partial(record, name=name))
    batch, _ = config_batch(IMAGES, 'mmengine')
    half = trace_for(MMFullyShard, FSDP2_BF16, model, batch)
    bf16, fp32 = torch.bfloat16, torch.float32
    assert seen['stem.0'] == (bf16, bf16, bf16)
    assert seen['stem.1'] == (fp32, fp32, fp32)  # cast back to bf16 after its own forward hooks
    assert seen['head'] == (bf16, bf16, bf16)
    assert half.compute_dtype == bf16
    full = trace_for(MMFullyShard, dict(type='mmfsdp.MMFullyShard'), _bn_model(), batch)
    assert half.activation_bytes < full.activation_bytes


def test_gradients_in_flight_are_counted_in_the_reduce_dtype():
    """bf16 compute, fp32 reduction: FSDP copies a unit's gradients into an fp32 reduce-scatter
    input, and gloo stages that input (measured: ResNet-18's 18 MiB fp32 input and its clone)."""
    model = _gpt()
    plans = {reduce: plan_for(MMFullyShard, dict(
        type='mmfsdp.MMFullyShard', auto_wrap_policy=BLOCKS,
        mixed_precision=dict(param_dtype='bf16', **({'reduce_dtype': reduce} if reduce else {}))),
        model, 2, dict(type='AdamW')) for reduce in (None, 'fp32')}
    half, wide = plans[None], plans['fp32']
    block = wide.largest_unit
    assert block.gathered_bytes == block.numel * 2 and block.reduced_bytes == block.numel * 4
    assert half.largest_unit.reduced_bytes == block.numel * 2  # reduce_dtype defaults to bf16
    assert wide.reduced_in_flight_bytes == max(u.reduced_bytes for u in wide.units)
    assert wide.gathered_in_flight_bytes == 2 * block.gathered_bytes + wide.reduced_in_flight_bytes
    assert (wide.gathered_in_flight_bytes - half.gathered_in_flight_bytes
            == wide.reduced_in_flight_bytes - half.reduced_in_flight_bytes > 0)
    trace = _trace(bf16=True)
    assert (step_peak(wide, trace, 2, heap_threshold=2**20).staging_bytes
            == wide.reduced_in_flight_bytes > block.gathered_bytes)
    # fp32 throughout: as before, gradients in flight as gathered
    fp32 = plan_for(MMFullyShard, dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=BLOCKS),
                    model, 2, dict(type='AdamW'))
    assert all(u.reduced_bytes == u.gathered_bytes for u in fp32.units)


# ---- detectors and segmenters: frozen stages, norms in eval mode, losses that read values ----


class FrozenStemNet(torch.nn.Module):
    """mmdet's backbone defaults: stem and first stage frozen (``frozen_stages=1``) and every
    BatchNorm in eval mode while training (``norm_eval=True``)."""

    def __init__(self, frozen: bool = True) -> None:
        super().__init__()
        conv, bn = torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8)
        self.stem = torch.nn.Sequential(conv, bn, torch.nn.ReLU())
        self.blocks = torch.nn.Sequential(Block(8), Block(8))
        self.head = torch.nn.Linear(8, 4)
        if frozen:
            self.stem.requires_grad_(False)
            self.blocks[0].requires_grad_(False)

    def train(self, mode: bool = True) -> 'FrozenStemNet':
        super().train(mode)
        for m in self.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()
        return self

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(inputs)).mean((2, 3)))


class MaskedLossHead(torch.nn.Module):
    """A dense head whose loss reads values, as detection and segmentation losses do: the
    ignored pixels dropped by a boolean mask (``aten.nonzero``), the count taken by ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 5, 1)

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.conv(x).permute(0, 2, 3, 1)
        valid = labels != 255
        count = valid.sum().item()
        picked = logits[valid]
        return dict(loss_cls=torch.nn.functional.cross_entropy(
            picked, labels[valid], reduction='sum') / max(count, 1))


class MaskedLossNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = torch.nn.Sequential(Block(8), Block(8))
        self.head = MaskedLossHead()

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict:
        return self.head.loss(self.blocks(self.stem(inputs)), labels)


BLOCK_UNITS = dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=dict(
    type='module_types', module_cls=['Block']))


def _images(n=4, size=16):
    torch.manual_seed(0)
    images = torch.randn(n, 3, size, size)
    labels = torch.randint(0, 5, (n, size, size))
    labels[:, :, : size // 4] = 255  # a quarter of every image ignored
    return images, labels


def _measured(model: torch.nn.Module, args: tuple) -> tuple:
    """(activations, peak) of one real step on the CPU, counted as the trace counts."""
    from mmfsdp.plan.trace import _LiveBytes, _loss
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, 'grad', None))
    live = _LiveBytes()
    with live:
        loss = _loss(model.train()(*args))
        activations = live.current
        loss.backward()
    return activations, live.peak


def test_a_frozen_stem_with_eval_norms_traces_as_training_runs_it():
    images, _ = _images()
    seen = {}
    model = FrozenStemNet()
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.register_forward_hook(functools.partial(
                lambda m, args, out, name: seen.update({name: m.training}), name=name))
    frozen = trace_for(MMFullyShard, BLOCK_UNITS, model, lambda m: ((images, ), {}))
    assert seen and not any(seen.values())  # norm_eval: every BatchNorm in eval mode
    trained = trace_for(MMFullyShard, BLOCK_UNITS, FrozenStemNet(frozen=False),
                        lambda m: ((images, ), {}))
    # nothing before the first trainable layer needs its input kept for backward
    assert frozen.activation_bytes < trained.activation_bytes
    assert (frozen.activation_bytes, frozen.peak_bytes) == _measured(FrozenStemNet(), (images, ))


def test_frozen_parameters_have_no_gradient_and_no_optimizer_state():
    model = FrozenStemNet()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adamw = dict(type='AdamW')
    fsdp2 = plan_for(MMFullyShard, BLOCK_UNITS, model, 2, adamw)
    fsdp1 = plan_for(MMFullyShardedDataParallel, dict(BLOCK_UNITS, type=FSDP['type']), model, 2,
                     adamw)
    ddp = plan_for(MMDistributedDataParallel, dict(type='mmfsdp.MMDistributedDataParallel'),
                   model, 2, adamw)
    units = {u.name: u for u in fsdp2.units}
    assert units['blocks.0'].param_bytes > 0  # frozen: held, gathered, never reduced
    assert units['blocks.0'].grad_bytes == units['blocks.0'].optimizer_bytes == 0
    assert units['blocks.0'].reduced_bytes == 0
    head = model.head.weight.numel() + model.head.bias.numel()  # the root's trainable part
    assert units[''].grad_bytes == (4 * 8 // 2 + 4 // 2) * 4 and units[''].reduced_bytes == head * 4
    assert units[''].optimizer_bytes == 2 * units[''].grad_bytes
    assert sum(u.grad_bytes for u in ddp.units) == 4 * sum(
        p.numel() for n, p in model.named_parameters() if n in trainable)
    # FSDP1 flattens a unit: a gradient for the whole flat shard where any parameter trains,
    # optimizer state for the trainable elements of the rank holding the most of them
    flat = {u.name: u for u in fsdp1.units}
    assert flat['blocks.0'].grad_bytes == flat['blocks.0'].optimizer_bytes == 0
    root_numel = flat[''].numel
    assert flat[''].grad_bytes == -(-root_numel // 2) * 4
    assert flat[''].optimizer_bytes == 2 * 4 * min(head, -(-root_numel // 2))
    assert fsdp2.unsharded_bytes == 4 * (fsdp2.numel + 3 * sum(
        p.numel() for n, p in model.named_parameters() if n in trainable))


def test_a_loss_that_reads_values_runs_on_real_tensors_inside_the_trace():
    images, labels = _images()
    trace = trace_for(MMFullyShard, BLOCK_UNITS, MaskedLossNet(),
                      lambda m: ((images, labels), {}))
    (part, ) = trace.real_parts
    # the head's loss, named with the first value it read
    assert part.startswith('head.loss (') and 'test_plan_peak.py' in part, part
    assert 'aten._local_scalar_dense' in part  # .item(), before the boolean mask
    # measured there as a real step measures it (the trace frees a few tensors later: 0.6 %)
    activations, peak = _measured(MaskedLossNet(), (images, labels))
    assert trace.activation_bytes - activations == 4  # the scalar that joins the two graphs
    assert 0 <= trace.peak_bytes - peak < 0.01 * peak


class _RecordedLayer(torch.nn.Module):
    """A checkpointed layer that records whether its weight is a fake tensor at each call."""

    seen: list = []  # on the class: the trace deep-copies the model

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from mmfsdp.compat import is_fake
        type(self).seen.append(is_fake(self.fc.weight))
        return torch.relu(self.fc(x))


class _ValueReadingEncoder(torch.nn.Module):
    """DINO's encoder: reads its levels' sizes (``.item()``), then runs checkpointed layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_RecordedLayer() for _ in range(2))

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        x = x[:, :int(sizes.sum().item())].float()
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_checkpointed_layer_on_real_tensors_recomputes_with_its_real_weights():
    # before, the recomputation in backward ran on the trace's fake weights: under AMP DINO
    # Swin-L's encoder then recomputed its LayerNorm statistics in bf16 where the forward had
    # fp32 ('Recomputed values ... have different metadata'), and the step could not be planned
    from mmengine.model import BaseModel

    class Net(BaseModel):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.encoder = torch.nn.Linear(4, 8), _ValueReadingEncoder()

        def forward(self, x, sizes, mode='loss'):
            return dict(loss=self.encoder(self.embed(x), sizes).sum())

    with torch.device('meta'):
        model = Net()
    wrapper = dict(type='mmfsdp.MMFullyShard', activation_checkpointing=dict(
        layer_cls=['_RecordedLayer']))
    batch = (torch.randn(2, 6, 4), torch.tensor([2, 3]))
    trace = trace_for(MMFullyShard, wrapper, model, lambda m: (batch, {}), autocast=torch.bfloat16)
    assert trace.real_parts[0].startswith('encoder.forward (')
    # the real part's forward and its recomputation, of both layers: real weights each time
    assert _RecordedLayer.seen[-4:] == [False, False, False, False], _RecordedLayer.seen


def test_a_part_on_real_tensors_is_bounded():
    from mmfsdp.plan.trace import trace_step
    images, labels = _images()
    with pytest.raises(RuntimeError, match=r'head\.loss.*more than 1\.0 KiB.*--input-shape'):
        trace_step(MaskedLossNet(), lambda m: ((images, labels), {}), real_bytes_limit=1024)


# ---- the pipeline at its largest scale (mmdet 3.3.0's and mmseg 1.2.2's shipped pipelines) ----

LOAD = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', with_bbox=True)]
PACK = [dict(type='RandomFlip', prob=0.5), dict(type='PackDetInputs')]
# retinanet_r50_fpn_ms-640-800-3x_coco.py
MULTI_SCALE = [*LOAD, dict(type='RandomChoiceResize',
                           scales=[(1333, 640), (1333, 672), (1333, 704), (1333, 736),
                                   (1333, 768), (1333, 800)], keep_ratio=True), *PACK]
# faster-rcnn_r50_fpn_mstrain-... : RandomResize between two scales
RANGE = [*LOAD, dict(type='RandomResize', scale=[(1333, 640), (1333, 800)], keep_ratio=True), *PACK]
# common/lsj-100e_coco-detection.py (large scale jitter)
LSJ = [*LOAD, dict(type='RandomResize', scale=(1024, 1024), ratio_range=(0.1, 2.0),
                   keep_ratio=True),
       dict(type='RandomCrop', crop_type='absolute_range', crop_size=(1024, 1024),
            recompute_bbox=True, allow_negative_crop=True),
       dict(type='FilterAnnotations', min_gt_bbox_wh=(1e-2, 1e-2)), *PACK]
# detr/detr_r50_8xb2-150e_coco.py
DETR = [*LOAD, dict(type='RandomFlip', prob=0.5), dict(type='RandomChoice', transforms=[
    [dict(type='RandomChoiceResize', scales=[(480, 1333), (512, 1333), (544, 1333), (576, 1333),
                                             (608, 1333), (640, 1333), (672, 1333), (704, 1333),
                                             (736, 1333), (768, 1333), (800, 1333)],
          keep_ratio=True)],
    [dict(type='RandomChoiceResize', scales=[(400, 1333), (500, 1333), (600, 1333)],
          keep_ratio=True),
     dict(type='RandomCrop', crop_type='absolute_range', crop_size=(384, 600),
          allow_negative_crop=True),
     dict(type='RandomChoiceResize', scales=[(480, 1333), (512, 1333), (544, 1333)],
          keep_ratio=True)]]), dict(type='PackDetInputs')]
# mmseg _base_/datasets/cityscapes.py
CITYSCAPES = [dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
              dict(type='RandomResize', scale=(2048, 1024), ratio_range=(0.5, 2.0),
                   keep_ratio=True),
              dict(type='RandomCrop', crop_size=(512, 1024), cat_max_ratio=0.75),
              dict(type='RandomFlip', prob=0.5), dict(type='PhotoMetricDistortion'),
              dict(type='PackSegInputs')]


def test_a_pipeline_that_draws_scales_is_planned_at_its_largest():
    from mmfsdp.plan.batch import largest_pipeline, worst_case_dataset

    def sizes(pipeline):
        return [(t['type'], t.get('scale', t.get('crop_size')), t.get('keep_ratio'))
                for t in largest_pipeline(pipeline)[0] if 'scale' in t or 'crop_size' in t]

    # keep_ratio: a (long, short) box, whose largest image has its aspect ratio: exactly it
    assert sizes(MULTI_SCALE) == [('Resize', (1333, 800), False)]
    assert sizes(RANGE) == [('Resize', (1333, 800), False)]
    assert sizes(LSJ) == [('Resize', (2048, 2048), False), ('RandomCrop', (1024, 1024), None)]
    assert sizes(CITYSCAPES) == [('Resize', (4096, 2048), False),
                                 ('RandomCrop', (512, 1024), None)]
    # RandomChoice: the branch ending with the larger image (both 1333 x 800 here: the first)
    assert sizes(DETR) == [('Resize', (1333, 800), False)]
    # a deterministic keep-ratio Resize is image-dependent too: its largest image
    assert sizes([dict(type='Resize', scale=(1333, 800), keep_ratio=True)]) == [
        ('Resize', (1333, 800), False)]
    assert largest_pipeline(PACK) == (PACK, [])
    # nested in dataset wrappers, the config left as it is
    cfg = dict(type='RepeatDataset', times=3, dataset=dict(type='CocoDataset', pipeline=LSJ))
    copy, notes = worst_case_dataset(cfg)
    assert cfg['dataset']['pipeline'] is LSJ and LSJ[2]['type'] == 'RandomResize'
    assert copy['dataset']['pipeline'][2]['scale'] == (2048, 2048)
    assert notes == ['RandomResize -> Resize 2048x2048', 'RandomCrop -> RandomCrop 1024x1024']


def test_the_config_batch_is_drawn_at_the_largest_scale():
    import numpy as np
    from mmengine.dataset import Compose
    from mmengine.model import BaseDataPreprocessor
    from mmengine.registry import DATASETS, TRANSFORMS
    from torch.utils.data import Dataset

    @TRANSFORMS.register_module(name='PlanTestResize', force=True)
    def resize(scale, keep_ratio):  # noqa: ARG001 (mmcv's Resize, keep_ratio=False)
        return lambda results: dict(results, img=np.zeros((scale[1], scale[0], 3), np.uint8))

    @TRANSFORMS.register_module(name='PlanTestPack', force=True)
    def pack():
        return lambda results: dict(inputs=torch.from_numpy(results['img']).permute(2, 0, 1),
                                    data_samples=0)

    @DATASETS.register_module(name='PlanTestImages', force=True)
    class Images(Dataset):
        def __init__(self, pipeline):
            self.pipeline = Compose(pipeline)

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return self.pipeline(dict(img=np.zeros((30, 40, 3), np.uint8)))

    pipeline = [dict(type='RandomChoiceResize', scales=[(64, 32), (80, 48), (72, 40)],
                     keep_ratio=True, resize_type='PlanTestResize'), dict(type='PlanTestPack')]
    batch, size = config_batch(dict(batch_size=2, dataset=dict(type='PlanTestImages',
                                                               pipeline=pipeline)), 'mmengine')
    holder = torch.nn.Module()
    holder.data_preprocessor = BaseDataPreprocessor()
    _, kwargs = batch(holder)
    assert size == 2 and [tuple(t.shape) for t in kwargs['inputs']] == [(3, 48, 80)] * 2
