"""``auto_wrap_policy='auto'`` against hand-written class lists, planned:
``python -m benchmarks.auto_wrap``.

For each model and world size, ``python -m mmfsdp.plan --format json`` plans FSDP2 with
the policy ``'auto'`` and with each hand-written list; the table gives the planned step
peak per rank (model states, gathered units, traced activations) of ``'auto'`` and of the
best list, and ``'auto'``'s largest unit against the largest block of the model. The
models are the demo GPT (``configs/gpt-nano_fsdp2_2xcpu.py``, its stdlib batch) and the
torchvision-free ResNet and ViT of ``tests/support/vision.py`` on 8 x 3 x 32 x 32
inputs. Block: ``auto-wrap``.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

from .core import records
from .core.records import mib

REPO = Path(__file__).resolve().parents[1]
#: name -> (config lines or a config file, extra plan arguments, hand-written class lists)
MODELS = {
    'demo GPT (gpt-nano)': (REPO / 'configs' / 'gpt-nano_fsdp2_2xcpu.py', [],
                            [['TransformerBlock'], ['TransformerBlock', 'Embedding']]),
    'BottleneckResNet': ("model = dict(type='BottleneckResNet', width=16)",
                         ['--input-shape', '8,3,32,32'], [['Bottleneck'], ['ResLayer']]),
    'TinyViT': ("model = dict(type='TinyViT', dim=64, depth=6)", ['--input-shape', '8,3,32,32'],
                [['EncoderLayer'], ['EncoderLayer', 'Attention']]),
}
WORLD_SIZES = ('2', '8')
POLICY = 'model_wrapper_cfg.auto_wrap_policy'
COLUMNS = ['model', 'N', "'auto' units", "'auto' peak MiB", 'best hand list', 'its peak MiB',
           'auto / hand', 'largest unit / largest block']


def plan(config: Any, extra: List[str], policy: List[str], tmp: str) -> List[Dict[str, Any]]:
    """The JSON plans (one per world size) of FSDP2 under ``policy`` (``--cfg-options``)."""
    if isinstance(config, str):  # a vision model of tests/support, registered by importing it
        path = Path(tmp) / 'model.py'
        path.write_text(f"custom_imports = dict(imports=['vision'])\n{config}\n"
                        "optim_wrapper = dict(optimizer=dict(type='AdamW', lr=1e-3))\n")
        config = path
    out = subprocess.run(
        [sys.executable, '-m', 'mmfsdp.plan', str(config), '--world-size', *WORLD_SIZES,
         '--format', 'json', '--cfg-options', 'model_wrapper_cfg.type=mmfsdp.MMFullyShard',
         *policy, *extra],
        check=True, capture_output=True, text=True, cwd=REPO,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / 'tests' / 'support'),
                                                         os.environ.get('PYTHONPATH', '')])))
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    records.add_output_options(parser, 'auto_wrap')
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, extra, lists) in MODELS.items():
            auto = plan(config, extra, [f'{POLICY}=auto'], tmp)
            hands = {'+'.join(cls): plan(config, extra, [f'{POLICY}.type=transformer',
                                                         f"{POLICY}.layer_cls=[{','.join(cls)}]"],
                                         tmp) for cls in lists}
            for i, size in enumerate(WORLD_SIZES):
                best = min(hands, key=lambda h: hands[h][i]['step']['peak_bytes'])
                peak, hand = auto[i]['step']['peak_bytes'], hands[best][i]['step']['peak_bytes']
                units = [u for u in auto[i]['units'] if u['name'] != '(root)']
                classes = sorted({u['cls'] for u in units})
                largest_block = max(u['numel'] for u in units)
                rows.append([name, size, f"{len(units)} x {'+'.join(classes)}", mib(peak), best,
                             mib(hand), f'{peak / hand:.3f}',
                             f"{max(u['numel'] for u in auto[i]['units']) / largest_block:.2f}"])
    records.save_results(args.out, [dict(zip(COLUMNS, row)) for row in rows])
    records.finish(args, {'auto-wrap': records.header('python -m benchmarks.auto_wrap') +
                          '\n\n' + records.table(COLUMNS, rows)})


if __name__ == '__main__':
    main()
