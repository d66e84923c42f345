"""The GPU benchmark: step time, tokens/s, peak memory and MFU of bf16 training on CUDA.

``torchrun --standalone --nproc-per-node N -m benchmarks.gpu [--model gpt-100m]``

Arms, one after the other in one process group (NCCL), each on the same model,
the same fixed batch and the same bf16 mixed precision (bf16 compute, fp32
master weights, gradient reduction and AdamW state):

- ``mmfsdp FSDP2``, ``mmfsdp FSDP1 FULL_SHARD``, ``mmfsdp DDP``: an iteration of
  ``FSDPRunner``'s own train loop (``IterBasedTrainLoop.run_iter``: hooks, data
  preprocessor, the wrapper's ``train_step``, ``OptimWrapper.update_params``);
  FSDP2 and FSDP1 cast with their mixed-precision policies, DDP with
  ``mmfsdp.AmpOptimWrapper`` (bf16 autocast);
- ``torch FSDP2``: a hand-written loop on ``fully_shard`` (one group per block,
  then the root) with the same ``MixedPrecisionPolicy``;
- ``torch FSDP2 + loss.item()``: the same loop reading the loss on the host
  every step, as mmengine's logging does (``MessageHub.update_scalars``): the
  host waits for the GPU once per step.

Give one arm per job (``--arms LABEL``) so that each measures a fresh process.

Each arm runs ``warmup`` untimed steps, then ``steps`` steps, each timed between
two ``torch.cuda.synchronize()``; the peak is ``torch.cuda.max_memory_allocated``
over the timed steps (reset after warm-up; parameters, gradients and AdamW
state are resident by then). MFU = achieved model FLOP/s per GPU / the peak
given by ``--peak-tflops`` (default: H100 SXM bf16 dense, 989 TFLOP/s), with
6·P + 12·L·d·T FLOPs per token (PaLM's count: P parameters, L layers,
width d, sequence length T). Rank 0 prints one ``RESULT <json>`` per arm.
"""
import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
from mmengine.registry import LOOPS
from mmengine.runner import IterBasedTrainLoop

from .workload import LR, MODELS, POLICY, build_model, make_runner, runner_cfg

__all__ = ['flops_per_token', 'main']

H100_SXM_BF16_DENSE_TFLOPS = 989.0
BF16 = dict(param_dtype='bf16', reduce_dtype='fp32')
#: label -> (model_wrapper_cfg, optim_wrapper type and extra keys)
MMFSDP_ARMS: Dict[str, Any] = {
    'mmfsdp FSDP2': (dict(type='mmfsdp.MMFullyShard', auto_wrap_policy=POLICY,
                          mixed_precision=BF16), {}),
    'mmfsdp FSDP1 FULL_SHARD': (dict(type='mmfsdp.MMFullyShardedDataParallel',
                                     sharding_strategy='FULL_SHARD', auto_wrap_policy=POLICY,
                                     mixed_precision=dict(BF16, buffer_dtype='fp32')), {}),
    'mmfsdp DDP': (dict(type='mmfsdp.MMDistributedDataParallel'),
                   dict(type='mmfsdp.AmpOptimWrapper', dtype='bfloat16')),
}


TORCH_ARMS = ('torch FSDP2', 'torch FSDP2 + loss.item()')


def flops_per_token(preset: str, params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6·P for the weights plus 12·L·d·T for attention."""
    shape = MODELS[preset]
    return 6 * params + 12 * shape['n_layer'] * shape['n_embd'] * seq_len


def _time_steps(step: Callable[[], Any], warmup: int, steps: int) -> Dict[str, Any]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times: List[float] = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return dict(times=times, peak_bytes=torch.cuda.max_memory_allocated())


@LOOPS.register_module(name='GpuBenchmarkLoop')
class GpuBenchmarkLoop(IterBasedTrainLoop):
    """Times ``run_iter`` on one fixed batch (see the module docstring)."""

    def __init__(self, runner: Any, dataloader: Any, warmup: int, steps: int,
                 **kwargs: Any) -> None:
        super().__init__(runner, dataloader, max_iters=warmup + steps, **kwargs)
        self.warmup, self.steps = warmup, steps
        self.measured: Dict[str, Any] = {}

    def run(self) -> Any:
        self.runner.call_hook('before_train')
        self.runner.call_hook('before_train_epoch')
        batch = next(self.dataloader_iterator)
        self.runner.model.train()
        self.measured = _time_steps(lambda: self.run_iter(batch), self.warmup, self.steps)
        self.runner.call_hook('after_train_epoch')
        self.runner.call_hook('after_train')
        return self.runner.model


def _mmfsdp_arm(label: str, args: argparse.Namespace) -> Dict[str, Any]:
    wrapper, optim = MMFSDP_ARMS[label]
    with tempfile.TemporaryDirectory(prefix='mmfsdp-gpu-bench-') as work_dir:
        cfg = runner_cfg(args.model, wrapper, work_dir, label.replace(' ', '-'), args.batch,
                         args.seq, 0, train_cfg=dict(type='GpuBenchmarkLoop',
                                                     warmup=args.warmup, steps=args.steps))
        cfg.optim_wrapper.update(optim)
        runner = make_runner(cfg)
        runner.train()
        measured = runner.train_loop.measured
        del runner
    return measured


def _torch_fsdp2_arm(args: argparse.Namespace, read_loss: bool) -> Dict[str, Any]:
    """Hand-written torch FSDP2 with the same model, batch and precision."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from mmfsdp.demo import StdlibCharDataset
    device = torch.device('cuda', torch.cuda.current_device())
    torch.manual_seed(0)
    model = build_model(args.model).to(device)
    model.init_weights()
    mesh = init_device_mesh('cuda', (dist.get_world_size(), ))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    dataset = StdlibCharDataset(block_size=args.seq, max_chars=200_000)
    samples = [dataset[i] for i in range(args.batch)]
    inputs = torch.stack([s['inputs'] for s in samples]).to(device)
    targets = torch.stack([s['data_samples'] for s in samples]).to(device)

    def step() -> None:
        loss = model(inputs, targets, mode='loss')['loss']
        if read_loss:
            loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _time_steps(step, args.warmup, args.steps)


def _result(label: str, measured: Dict[str, Any], args: argparse.Namespace,
            params: int) -> Dict[str, Any]:
    world = dist.get_world_size()
    peaks: List[int] = [0] * world
    dist.all_gather_object(peaks, measured['peak_bytes'])
    step_s = statistics.median(measured['times'])
    tokens_per_step = args.batch * args.seq * world
    flops_per_gpu = flops_per_token(args.model, params, args.seq) * args.batch * args.seq / step_s
    return dict(
        kind='gpu', arm=label, model=args.model, params=params, world_size=world,
        batch_per_rank=args.batch, seq_len=args.seq, warmup=args.warmup, steps=args.steps,
        step_time_s=dict(median=step_s, min=min(measured['times']),
                         max=max(measured['times'])),
        tokens_per_s=tokens_per_step / step_s, peak_bytes_per_rank=peaks,
        allocated_before_bytes=measured['baseline_bytes'],
        tflops_per_gpu=flops_per_gpu / 1e12, peak_tflops=args.peak_tflops,
        mfu=flops_per_gpu / (args.peak_tflops * 1e12),
        device=torch.cuda.get_device_name(), torch=torch.__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', default='gpt-100m', choices=sorted(MODELS))
    parser.add_argument('--batch', type=int, default=64, help='sequences per rank per step')
    parser.add_argument('--seq', type=int, default=128)
    parser.add_argument('--warmup', type=int, default=5)
    parser.add_argument('--steps', type=int, default=30)
    parser.add_argument('--peak-tflops', type=float, default=H100_SXM_BF16_DENSE_TFLOPS,
                        help='the GPU bf16 dense peak that MFU is relative to')
    parser.add_argument('--arms', nargs='*', default=[*MMFSDP_ARMS, *TORCH_ARMS])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit('benchmarks.gpu needs a CUDA GPU')
    from mmfsdp.dist import init_distributed
    init_distributed('pytorch', dict(timeout=900))
    params = sum(p.numel() for p in build_model(args.model, 'meta').parameters())
    try:
        for label in args.arms:
            baseline = torch.cuda.memory_allocated()
            measured = (_torch_fsdp2_arm(args, label.endswith('.item()'))
                        if label.startswith('torch FSDP2') else _mmfsdp_arm(label, args))
            measured['baseline_bytes'] = baseline
            gc.collect()
            torch.cuda.empty_cache()
            result = _result(label, measured, args, params)
            if dist.get_rank() == 0:
                print('RESULT ' + json.dumps(result), flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == '__main__':
    sys.exit(main())
