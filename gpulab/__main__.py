import sys

from gpulab.cli import main

sys.exit(main())
