"""The experiments run from the checkout (the wheel installs jattn and pallas_kernels only): put
the repository root first on sys.path so ``import experiments`` finds it under any runner."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
