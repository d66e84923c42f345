"""The differential tier's draws (tests/differential/cases.py), without running a case.

A seed must name one case for good (failures are reported by seed), every drawn case must be
one the oracles can judge, and the configs must be what ``tools/train.py`` reads.
"""
import dataclasses

from mmengine.config import Config

from differential.cases import (
    MAX_ITERS,
    Case,
    canonical,
    case_config,
    draw,
    stock_config,
    stock_key,
    variants,
)
from differential.test_differential import signature

SEEDS = range(600)


def test_a_seed_draws_the_same_case_every_time():
    assert [draw(s) for s in SEEDS] == [draw(s) for s in SEEDS]
    assert len({repr(draw(s).axes()) for s in SEEDS}) > 400  # and the draws differ


def test_drawn_cases_are_canonical_and_resume_at_the_end_of_an_accumulation_window():
    for seed in SEEDS:
        case = draw(seed)
        assert canonical(case) == case, case
        if case.checkpoint == 'resume':
            assert case.ckpt_interval % case.accumulate == 0 and case.ckpt_interval < MAX_ITERS


def test_every_axis_value_is_drawn():
    cases = [draw(s) for s in range(3000)]
    for axis, values in dict(
            wrapper={'ddp', 'fsdp1', 'fsdp1-shard_grad_op', 'fsdp1-no_shard', 'fsdp2',
                     'fsdp2-zero2'},
            precision={'fp32', 'bf16', 'bf16-reduce-fp32', 'amp-fp16', 'amp-bf16'},
            accumulation={'sharded', 'unsharded', 'hybrid'},
            evaluation={'none', 'interval', 'val-first', 'hook'},
            checkpoint={'none', 'resume', 'async-exit', 'publish'},
            strategy={'none', 'deepspeed', 'fsdp'}, model={'toy', 'gpt'}).items():
        assert {getattr(c, axis) for c in cases} == values, axis


def test_shrinking_a_case_resets_what_its_axes_make_irrelevant():
    case = Case(seed=1, wrapper='fsdp2', precision='bf16', accumulate=2, accumulation='unsharded',
                checkpoint='resume', ckpt_interval=4)
    assert canonical(dataclasses.replace(case, wrapper='ddp')) == Case(
        seed=1, accumulate=2, checkpoint='resume', ckpt_interval=4)
    assert canonical(dataclasses.replace(case, accumulate=1)).accumulation == 'sharded'
    assert canonical(dataclasses.replace(case, checkpoint='none')).ckpt_interval == 3


def test_cases_that_differ_only_in_what_the_stock_runner_ignores_share_one_stock_run():
    a = Case(seed=1, wrapper='fsdp2', precision='bf16', checkpointing='full', evaluation='hook',
             val_at=3)
    b = Case(seed=2, wrapper='ddp', checkpoint='resume', evaluation='hook', val_at=3)
    assert stock_key(a) == stock_key(b)
    assert stock_key(a) != stock_key(dataclasses.replace(a, val_at=2))
    clip = Case(seed=1, strategy='deepspeed', ds_clipping=0.05, checkpoint='publish')
    assert stock_key(clip) != stock_key(dataclasses.replace(clip, ds_clipping=1.0))
    assert stock_key(dataclasses.replace(clip, ds_clipping=0.0)) == stock_key(
        dataclasses.replace(clip, ds_clipping=None))  # DeepSpeed's 0 is no clipping


def test_the_configs_of_every_variant_are_mmengine_configs(tmp_path):
    for seed in range(60):
        case = draw(seed)
        for variant in variants(case):
            cfg = Config(case_config(case, variant, str(tmp_path), 'x'))
            assert cfg.launcher == 'pytorch'
            assert 'val_dataloader' in cfg or not (variant == 'eval' and case.evaluation in (
                'interval', 'val-first'))
        stock = Config(stock_config(case, 'base', str(tmp_path), 'x'))
        assert stock.launcher == 'none' and 'model_wrapper_cfg' not in stock


def test_a_failure_signature_ignores_the_numbers():
    assert signature(['stock: final weights 0.0594 from the stock run (tolerance 2e-05)']) == \
        signature(['stock: final weights 1.5e-3 from the stock run (tolerance 2e-05)'])
