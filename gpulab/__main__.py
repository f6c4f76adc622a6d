import sys

from gpulab.cli import run

sys.exit(run())
