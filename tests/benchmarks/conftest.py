"""The benchmark tests: report rendering (no processes) and one smoke run per script.

Opt-in (``-m bench``): they check the benchmarks, not mmfsdp.
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO not in sys.path:  # the benchmarks package lives at the repository root
    sys.path.insert(0, REPO)
