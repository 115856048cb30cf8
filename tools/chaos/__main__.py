"""`python tools/chaos [flags]`: run the harness.  The package is imported by its name
`chaos` (tools/ on sys.path), so that the workers, which import `chaos` too, run the same
module objects."""
import os
import sys

# `python tools/chaos` puts tools/chaos itself first on sys.path, where the modules would
# be importable a second time under bare names: put tools/ there instead
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from chaos import main  # noqa: E402 -- after the path is set

sys.exit(main())
