import sys

from stppo_agent.cli import main

sys.exit(main())
