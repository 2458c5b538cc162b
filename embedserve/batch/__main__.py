"""`python -m embedserve.batch INPUT OUTPUT --url ... --model ...`: the same as `embedserve batch`."""

import sys

from embedserve.batch.cli import run

sys.exit(run(sys.argv[1:]))
