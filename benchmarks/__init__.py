"""Benchmarks of mmfsdp: one script per question, each refreshing its tables in docs/benchmarks.md.

``python -m benchmarks.<script> [--help] [--write-docs]``: ``memory`` (model state, peak and
communication per rank), ``overhead`` (FSDPRunner + mmfsdp against hand-written torch),
``checkpoint_cost``, ``construction`` (eager vs meta init), ``accumulation``, ``peers``
(accelerate, Lightning Fabric, mmengine's FlexibleRunner), ``peak_truth`` (the plan's step peak
against the measured one), ``compile``, ``load_bytes``, ``async_save``. What they share is in
:mod:`benchmarks.core`.
"""
