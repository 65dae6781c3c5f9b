import sys

from nanoeuler.cli import main

sys.exit(main())
