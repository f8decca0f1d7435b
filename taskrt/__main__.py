import sys

from taskrt.cli import main

sys.exit(main())
