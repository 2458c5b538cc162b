import sys

from embedserve.ray_data.job import main

sys.exit(main())
