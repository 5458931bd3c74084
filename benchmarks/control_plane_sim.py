"""The control-plane simulator's command line: ``python benchmarks/control_plane_sim.py --help``.

The simulator is the package :mod:`benchmarks.control_plane` next to this
file (run as a script, this file's folder is first on the path, so the
package imports as ``control_plane``).
"""

import sys

from control_plane.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
