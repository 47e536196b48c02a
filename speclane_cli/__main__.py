import sys

from speclane_cli.main import main

sys.exit(main())
