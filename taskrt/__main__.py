import sys

from taskrt.cli import main

if __name__ == "__main__":  # worker processes re-import this module: do not run there
    sys.exit(main())
