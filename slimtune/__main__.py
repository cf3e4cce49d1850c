import sys

from slimtune.cli import main

sys.exit(main())
