"""``python -m streams.kube.applying apply …``, the same as ``vmstream apply …``."""

import sys

from streams.kube.applying.process import main

sys.exit(main())
