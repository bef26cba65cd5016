import sys

from nightshift.train.cli import main

sys.exit(main())
