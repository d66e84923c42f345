"""Each benchmark script's smallest configuration, end to end: torchrun jobs of the tiny GPT
(or tiny vision models) at N <= 2, the printed table and the refresh of the script's blocks
in a copy of ``docs/benchmarks.md``."""
import os
import shutil
import subprocess
import sys

import pytest

from harness import REPO

pytestmark = pytest.mark.bench
TINY = ['--seq-len', '32']
SMOKE = {
    'memory': (['--models', 'gpt-tiny', '--world-sizes', '2', '--strategies', 'FSDP2 reshard',
                'FSDP1 FULL_SHARD', '--steps', '1', *TINY],
               ['model-state', 'peak', 'comm', 'fsdp2-vs-fsdp1']),
    'overhead': (['--model', 'gpt-tiny', '--wrappers', 'fsdp2', '--warmup', '1', '--steps', '2',
                  *TINY], ['overhead', 'fsdp2-vs-fsdp1-time']),
    'checkpoint_cost': (['--model', 'gpt-tiny', '--repeats', '1'], ['checkpoint-cost']),
    'construction': (['--model', 'gpt-tiny', '--world-sizes', '2', '--wrappers', 'fsdp2',
                      '--inits', 'meta', '--repeats', '1'], ['construction']),
    'accumulation': (['--model', 'gpt-tiny', '--world-sizes', '2', '--wrappers', 'fsdp2',
                      '--counts', '2', *TINY], ['accumulation']),
    'async_save': (['--model', 'gpt-tiny', '--world-sizes', '2', '--repeats', '1',
                    '--strategies', 'FSDP2 reshard', '--formats', 'sharded'], ['async-save']),
    'load_bytes': (['--model', 'gpt-tiny', '--nproc', '2', '--strategies', 'FSDP2 reshard'],
                   ['load-bytes']),
    'peak_truth': (['--models', 'gpt-tiny', '--world-sizes', '2', '--batch-sizes', '2',
                    '--strategies', 'DDP'], ['peak-truth']),
    'compile': (['--quick', '--only', 'vit/eager'], ['compile']),
    'auto_wrap': (['--models', 'TinyViT', 'mmpretrain ViT'], ['auto-wrap']),  # zoo: skipped
    'fp32_norms': (['--models', 'BottleneckResNet', 'ResNet-50', '--size', '32', '--warmup', '1',
                    '--rounds', '2'], ['fp32-norms']),  # ResNet-50 needs torchvision: skipped
    'peers': (['--model', 'gpt-tiny', '--arms', 'torch DDP', 'mmfsdp DDP', '--skip-memory',
               '--steps', '3', *TINY], ['peers']),
}


def _block(text, name):
    return text.split(f'<!-- begin: {name} -->', 1)[1].split(f'<!-- end: {name} -->', 1)[0]


@pytest.mark.parametrize('script', sorted(SMOKE))
def test_the_smallest_run_prints_its_table_and_refreshes_its_blocks(script, tmp_path):
    args, blocks = SMOKE[script]
    doc = tmp_path / 'benchmarks.md'
    shutil.copy(os.path.join(REPO, 'docs', 'benchmarks.md'), doc)
    before = doc.read_text()
    proc = subprocess.run(
        [sys.executable, '-m', f'benchmarks.{script}', *args, '--out', str(tmp_path / 'r.json'),
         '--write-docs', str(doc)], cwd=REPO, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    after = doc.read_text()
    for name in blocks:
        assert f'<!-- {name} -->\n' in proc.stdout
        new = _block(after, name)
        assert new != _block(before, name) and new.strip() in proc.stdout
        assert '| ' in new or name == 'fsdp2-vs-fsdp1-time'
    assert after.replace(''.join(_block(after, n) for n in blocks), '') != ''
    assert (tmp_path / 'r.json').exists()
