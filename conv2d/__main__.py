import sys

from conv2d.cli import main

sys.exit(main())
