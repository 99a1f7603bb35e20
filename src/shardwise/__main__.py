"""``python -m shardwise`` (also how torchrun starts it: ``torchrun ... -m shardwise train``)."""

import sys

from shardwise.cli import main

sys.exit(main())
