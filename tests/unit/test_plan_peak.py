"""The plan's step peak: activations traced with fake tensors, the parts of a peak, budgets."""
import functools

import pytest
import torch

from mmfsdp.plan import heap_threshold, plan_for, step_peak, trace_for
from mmfsdp.plan.allocator import GLIBC_MAX_MMAP_THRESHOLD
from mmfsdp.plan.batch import config_batch, shape_batch
from mmfsdp.plan.fit import parse_bytes
from mmfsdp.wrappers import MMDistributedDataParallel, MMFullyShard, MMFullyShardedDataParallel
from vision import IMAGES, PREPROCESSOR, ConvBNClassifier

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
