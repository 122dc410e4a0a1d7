"""`python -m tandem.deploy.cli`: the `tandem` command."""

import sys

from tandem.deploy.cli.main import main

sys.exit(main())
