import sys

from pipeline.core import supervise

# the supervisor decides before the CLI is imported: the watching parent needs none of it (~0.7 s of imports)
if supervise.wanted(sys.argv[1:]):          # a kernel-killed stage then gets a clear line
    sys.exit(supervise.run_supervised(sys.argv[1:]))

from pipeline.cli import main  # noqa: E402

sys.exit(main())
