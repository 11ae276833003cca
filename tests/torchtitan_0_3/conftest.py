"""Tests of the TorchTitan 0.3.0 edge; each module skips itself unless TorchTitan 0.3.0 is installed."""

import sys
from pathlib import Path

# tests/: the helpers every edge's tests share (torchtitan_release, training).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
