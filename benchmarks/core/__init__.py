"""What every benchmark script shares: the workload, the probes, the torchrun launch, the records.

- :mod:`.workload`: the GPT presets, the wrapper strategies with their theory, runner
  configs and hand-written torch loops;
- :mod:`.measure`: resident set and its peak, model-state bytes, collective bytes;
- :mod:`.launch`: one torchrun job per measurement, under a deadline;
- :mod:`.records`: raw results under ``work_dirs/benchmarks/``, Markdown tables and the
  marked blocks of ``docs/benchmarks.md``.
"""
