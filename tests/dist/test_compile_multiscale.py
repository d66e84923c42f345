"""Regional compile with multi-scale inputs: the layers stay compiled; a reached limit is logged.

A detection pipeline draws many image sizes. The compiled layers of one class share one
``forward`` and torch's limit of graphs on it (8 by default); a ResNet has several kinds
of ``Bottleneck`` (widths, with or without projection), so under ``dynamic=False`` the
kinds together used up the limit after two sizes and every layer then ran eager, silently
(before this test: graphs 8, compiled calls [4, 4, 0, 0, 0, 0], no warning in the log).
mmfsdp takes the limit once per kind of layer, and a reached limit is a warning in the log.
Under FSDP2 at 2 ranks, with a counting ``aot_eager`` backend (no code generation).
"""
import copy
import datetime
import logging

import torch

from harness import COLLECTIVE_TIMEOUT_S, max_abs_diff, run_distributed

#: K distinct (H, W) sizes: 4 kinds x 6 sizes = 24 graphs, past torch's default limit of 8
#: graphs per function (and within 8 sizes per kind, the limit mmfsdp takes).
SIZES = [(32 + 8 * i, 48 - 8 * (i % 3)) for i in range(6)]
KINDS = 4  # Bottleneck kinds of BottleneckResNet(width=4, depths=(2, 2))


def _run() -> dict:
    import torch.distributed as dist
    from mmengine.logging import MMLogger
    from torch._dynamo import lookup_backend, register_backend

    from mmfsdp import MMFullyShard
    from vision import BottleneckResNet
    dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    count = dict(graphs=0, calls=0)

    @register_backend(name='aot_eager_multiscale')
    def counted(graph, example_inputs):
        count['graphs'] += 1
        compiled = lookup_backend('aot_eager')(graph, example_inputs)

        def call(*args):
            count['calls'] += 1
            return compiled(*args)
        return call

    warnings = []

    class Caught(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())
    MMLogger.get_instance('multiscale').addHandler(Caught())
    out = {}
    for name, extra in (('default', {}), ('limit 2', dict(recompile_limit=2))):
        torch._dynamo.reset()
        torch.manual_seed(0)
        eager = BottleneckResNet(width=4, depths=(2, 2))
        model = MMFullyShard.from_options(copy.deepcopy(eager), auto_wrap_policy=dict(
            type='transformer', layer_cls=['Bottleneck']), regional_compile=dict(
            layer_cls=['Bottleneck'], backend='aot_eager_multiscale', **extra))
        graphs, calls, diffs, seen = count['graphs'], [], [], len(warnings)
        for h, w in SIZES:
            x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(h * w))
            before = count['calls']
            model(x).sum().backward()
            eager(x).sum().backward()
            calls.append(count['calls'] - before)
            got = {n: p.grad.full_tensor() for n, p in model.module.named_parameters()}
            diffs.append(max_abs_diff(got, {n: p.grad for n, p in eager.named_parameters()}))
            model.zero_grad(), eager.zero_grad()
        out[name] = dict(graphs=count['graphs'] - graphs, calls=calls, diff=max(diffs),
                         warnings=warnings[seen:])
    dist.destroy_process_group()
    return out


def test_every_layer_stays_compiled_past_the_default_limit_and_a_reached_limit_is_logged():
    out = run_distributed(_run, 2, timeout=600)[0]
    default, limited = out['default'], out['limit 2']
    print({k: (v['graphs'], v['calls'], v['diff']) for k, v in out.items()})
    # one graph per kind and size, and every Bottleneck called compiled at every size
    assert default['graphs'] == KINDS * len(SIZES)
    assert default['calls'] == [KINDS] * len(SIZES)
    assert default['diff'] <= 1e-5 and default['warnings'] == []
    # a limit the config gives is torch's meaning (per function): reached, it is a warning
    assert limited['calls'][-1] == 0 and limited['diff'] <= 1e-5
    assert len(limited['warnings']) == 1
    assert 'regional_compile' in limited['warnings'][0]
    assert 'recompile_limit (2)' in limited['warnings'][0]
