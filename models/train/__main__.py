"""``python -m models.train``: the training job's command line."""

import sys

from models.train._cli import main

sys.exit(main())
