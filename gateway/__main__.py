import sys

from speclane.cli import main

main(["gateway", *sys.argv[1:]])
