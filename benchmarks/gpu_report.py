"""The GPU section of ``docs/benchmarks.md``, from ``benchmarks/results/gpu.json``.

That file holds the ``RESULT`` lines of :mod:`benchmarks.gpu` jobs (``results``,
one entry per arm and batch size) and what was observed while taking them
(``notes``), collected on a GPU machine: the CPU suite cannot produce it, so
:func:`benchmarks.report.render` only reads it.
"""
import json
import os
from typing import Any, Dict, List

__all__ = ['RESULTS', 'gpu_lines', 'load']

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'results', 'gpu.json')


def load(path: str = RESULTS) -> Dict[str, Any]:
    """The recorded GPU results and notes (empty when the file is absent)."""
    if not os.path.exists(path):
        return dict(results=[], notes=[])
    with open(path) as f:
        return json.load(f)


def _row(r: Dict[str, Any]) -> List[str]:
    step = r['step_time_s']
    return [r['arm'], str(r['batch_per_rank']),
            f"{step['median'] * 1e3:.1f} ({step['min'] * 1e3:.1f}–{step['max'] * 1e3:.1f})",
            f"{r['tokens_per_s'] / 1e3:.0f}k",
            ', '.join(f'{b / 2**30:.2f}' for b in r['peak_bytes_per_rank']),
            f"{r['tflops_per_gpu']:.0f}", f"{100 * r['mfu']:.1f}%"]


def gpu_lines(recorded: Dict[str, Any]) -> List[str]:
    """The section as Markdown lines (nothing without results)."""
    results = recorded['results']
    if not results:
        return []
    r0 = results[0]
    header = ['arm', 'batch / rank', 'step ms, median (min–max)', 'tokens/s',
              'peak GiB per rank', 'TFLOP/s per GPU', 'MFU']
    lines = [
        f"## 10. GPU: {r0['device']}, bf16", '',
        f"`torchrun --standalone --nproc-per-node {r0['world_size']} -m benchmarks.gpu "
        f"--batch B`, torch {r0['torch']}, **world size {r0['world_size']}** (one GPU: FSDP "
        'shards over one rank, so this measures the wrappers\' compute path and memory, not '
        f"communication). GPT {r0['params'] / 1e6:.1f}M, sequence {r0['seq_len']}, bf16 compute "
        'with fp32 master weights, gradient reduction and AdamW state; one fixed batch; '
        f"{r0['warmup']} warm-up steps, then {r0['steps']} steps each timed between two "
        '`torch.cuda.synchronize()`. Peak: `torch.cuda.max_memory_allocated()` over the timed '
        'steps. MFU: (6·P + 12·L·d·T) FLOPs per token × tokens/s per GPU / '
        f"{r0['peak_tflops']:.0f} TFLOP/s (H100 SXM bf16 dense peak, datasheet; an 8192³ bf16 "
        'matmul reaches about 800 TFLOP/s on this machine). Each arm is its own torchrun job.', '',
        '| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    lines += ['| ' + ' | '.join(_row(r)) + ' |' for r in results]
    lines += [''] + [f'- {note}' for note in recorded.get('notes', [])]
    return lines + ['']
