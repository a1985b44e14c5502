import sys

from worker.service import main

sys.exit(main())
