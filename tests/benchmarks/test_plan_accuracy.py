"""The plan's step peak is within 10 % of the measured one (the sharding plan's promise).

One FSDP2 job on 2 ranks (gpt-25m, batch 8, with and without activation
checkpointing), measured by ``python -m benchmarks.peak_truth`` as docs/benchmarks.md
section 12 measures it: under glibc with the benchmarks' 1 MiB mmap threshold, and
under jemalloc preloaded as ``tools/dist_train.sh`` preloads it where it is installed.
"""
import json
import subprocess
import sys

import pytest

from harness import REPO

pytestmark = pytest.mark.bench


@pytest.mark.parametrize('cpu_allocator', ['glibc', 'jemalloc'])
def test_predicted_peak_is_within_10_percent_of_the_measured_peak(cpu_allocator, tmp_path):
    from benchmarks.core.launch import JobFailed, preload_for
    if cpu_allocator != 'glibc':
        try:
            preload_for(cpu_allocator)
        except JobFailed:
            pytest.skip(f'{cpu_allocator} is not installed (Debian: apt-get install libjemalloc2)')
    out = tmp_path / 'peak.json'
    subprocess.run([sys.executable, '-m', 'benchmarks.peak_truth', '--models', 'gpt-25m',
                    '--world-sizes', '2', '--batch-sizes', '8', '--strategies', 'FSDP2 reshard',
                    '--cpu-allocator', cpu_allocator, '--out', str(out)],
                   cwd=REPO, check=True, timeout=900)
    results = json.loads(out.read_text())['results']
    assert {r['ac'] for r in results} == {False, True}
    for r in results:
        measured, predicted = r['peak_bytes']['median'], r['predicted']['peak_bytes']
        print(f"{r['name']}: measured {measured / 2**20:.1f} MiB, "
              f"predicted {predicted / 2**20:.1f} MiB")
        assert abs(predicted - measured) <= 0.10 * measured, r['name']


@pytest.mark.parametrize('model,strategy', [
    ('fcn-r18', 'FSDP2 reshard'), ('retinanet-r18', 'FSDP1 FULL_SHARD'),
    pytest.param('retinanet-r18', 'FSDP2 reshard', marks=pytest.mark.xfail(strict=True, reason=(
        'FSDP2 measures 50 MiB below FSDP1 on RetinaNet, whose root unit (FPN + head, 8.6 M '
        'parameters) is larger than any block; the plan predicts both alike, +13 % here: the '
        "second unit in flight and the root's gloo staging, which the peak in the head's "
        'backward does not hold (docs/benchmarks.md section 12)')))])
def test_a_detector_and_a_segmenter_are_predicted_within_10_percent(model, strategy, tmp_path):
    """mmdet's shipped RetinaNet and mmseg's FCN (ResNet-18), 2 ranks, batch 2, AC off and on."""
    try:
        import mmdet.models  # noqa: F401  (imports mmcv.ops: the zoo environment's)
        import mmseg.models  # noqa: F401
    except Exception as e:
        pytest.skip(f'mmdet / mmseg cannot be imported here (.venv-zoo/bin/python): {e}')
    out = tmp_path / 'peak.json'
    subprocess.run([sys.executable, '-m', 'benchmarks.peak_truth', '--models', model,
                    '--world-sizes', '2', '--batch-sizes', '2', '--strategies', strategy,
                    '--out', str(out)], cwd=REPO, check=True, timeout=1800)
    results = json.loads(out.read_text())['results']
    assert {r['ac'] for r in results} == {False, True}
    for r in results:
        measured, predicted = r['peak_bytes']['median'], r['predicted']['peak_bytes']
        print(f"{r['name']}: measured {measured / 2**20:.1f} MiB, "
              f"predicted {predicted / 2**20:.1f} MiB")
        assert abs(predicted - measured) <= 0.10 * measured, r['name']


def test_the_zoo_blocks_are_in_the_docs_page_once():
    from benchmarks.core import records
    with open(records.DOCS) as f:
        page = f.read()
    for name in ('peak-truth-zoo', 'dino-swin-l'):
        assert page.count(f'<!-- begin: {name} -->') == 1, name
        assert page.count(f'<!-- end: {name} -->') == 1, name
