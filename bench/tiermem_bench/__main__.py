import sys

from tiermem_bench.cli import main

sys.exit(main())
