import sys

from rlfw.cli import main

sys.exit(main())
