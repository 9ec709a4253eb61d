import sys

from gpud_client.run import main

sys.exit(main(prog="gpud-run"))
