import sys

from gpusnap.shim.main import main

sys.exit(main())
