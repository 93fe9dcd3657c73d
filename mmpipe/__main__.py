import sys

from mmpipe.cli import main

sys.exit(main())
